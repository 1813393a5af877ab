"""Token attributes, special token ids and end-of-generation tokens, by llama.cpp's loading rules.

GGUF files record a type per token, but llama.cpp also recognises many special tokens by their
text (converters often forgot to mark them): it promotes them to control tokens, which changes
how text containing them is tokenized, and it derives the end-of-generation set from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntFlag
from typing import Any

from strata.errors import ModelFormatError


class TokenAttr(IntFlag):
    """llama.cpp's `llama_token_attr` bits that matter to a BPE or SentencePiece vocabulary."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# GGUF `tokenizer.ggml.token_type` values
_ATTR_OF_TYPE = {
    1: TokenAttr.NORMAL, 2: TokenAttr.UNKNOWN, 3: TokenAttr.CONTROL, 4: TokenAttr.USER_DEFINED,
    5: TokenAttr.UNUSED, 6: TokenAttr.BYTE,
}

_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
    "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
# metadata key suffix -> token texts that llama.cpp takes for it when the key is absent
_DETECTED_BY_TEXT = {
    "eot": _EOT_TEXTS,
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_DEPRECATED_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}
_EOG_TEXTS = frozenset(_EOT_TEXTS) | {
    "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "</s>", "<|eom_id|>", "[EOS]", "<eos>", "<turn|>",
    "<|tool_response>", "[e~[",
}
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    eog_ids: frozenset[int]
    attrs: tuple[TokenAttr, ...]


def attrs_from_types(types: Sequence[int] | None, num_tokens: int) -> list[TokenAttr]:
    if types is None:
        return [TokenAttr.NORMAL] * num_tokens
    if len(types) < num_tokens:
        raise ModelFormatError(
            f"tokenizer.ggml.token_type has {len(types)} entries, expected one per token ({num_tokens})"
        )
    return [_ATTR_OF_TYPE.get(int(t), TokenAttr.UNDEFINED) for t in types[:num_tokens]]


def resolve_special_tokens(metadata: Mapping[str, Any], texts: Sequence[str], types: list[TokenAttr],
                           default_bos_eos: tuple[int, int]) -> SpecialTokens:
    """Special ids from the metadata or, where absent, from token texts; attrs updated as llama.cpp does.
    `default_bos_eos` are the vocabulary type's ids for BOS and EOS when their keys are absent."""
    num_tokens = len(texts)
    attrs = list(types)
    id_of_text = {text: i for i, text in enumerate(texts)}
    default_bos, default_eos = (i if i < num_tokens else None for i in default_bos_eos)
    ids = {"bos": _id_key(metadata, "bos", num_tokens, default_bos),
           "eos": _id_key(metadata, "eos", num_tokens, default_eos)}
    for name, candidates in _DETECTED_BY_TEXT.items():
        ids[name] = _id_key(metadata, name, num_tokens, None)
        if name in _DEPRECATED_KEYS:  # read after the new key, so it wins when both are present
            ids[name] = _id_key(metadata, _DEPRECATED_KEYS[name], num_tokens, ids[name])
        if ids[name] is None:
            found = sorted(id_of_text[t] for t in candidates if t in id_of_text)
            if found:
                ids[name] = found[0]
                attrs[found[0]] |= TokenAttr.CONTROL
    eog = {ids[name] for name in ("fim_pad", "fim_rep", "fim_sep") if ids[name] is not None}
    for text, i in id_of_text.items():
        if text in _EOG_TEXTS:
            eog.add(i)
            attrs[i] |= TokenAttr.CONTROL
    for text in _ALWAYS_RENDERED:
        if text in id_of_text:
            attrs[id_of_text[text]] = TokenAttr.USER_DEFINED
    eog |= {ids[name] for name in ("eos", "eot", "eom") if ids[name] is not None}
    eog = _drop_non_final(eog, texts, attrs)
    return SpecialTokens(ids["bos"], ids["eos"], ids["eot"], ids["eom"], frozenset(eog), tuple(attrs))


def _drop_non_final(eog: set[int], texts: Sequence[str], attrs: list[TokenAttr]) -> set[int]:
    """Two exceptions llama.cpp makes: `<|end|>` ends a message, not generation, where `<|return|>`
    and `<|call|>` exist (or `<|calls|>` and `<|flush|>`); `</s>` is plain text next to gemma-4's
    or PLaMo's own end markers."""
    eog_texts = {texts[i]: i for i in sorted(eog)}
    has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
    is_end_non_final = "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts)
    if is_end_non_final:
        eog.discard(eog_texts["<|end|>"])
        attrs[eog_texts["<|end|>"]] = TokenAttr.USER_DEFINED
    if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
        eog.discard(eog_texts["</s>"])
        attrs[eog_texts["</s>"]] = TokenAttr.NORMAL
    return eog


def _id_key(metadata: Mapping[str, Any], name: str, num_tokens: int, default: int | None) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return default
    value = int(value)
    # llama.cpp ignores an out-of-range id and keeps its default
    return value if 0 <= value < num_tokens else default

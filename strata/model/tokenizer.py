"""Tokenization from a GGUF's own metadata, matching llama.cpp token for token.

Two vocabulary types. Byte-level BPE (`gpt2`): HF `tokenizers` runs it with the metadata's
vocabulary and merges, llama.cpp's pre-tokenizer regexes, then the byte-level mapping.
SentencePiece (`llama`): `strata.model.spm` merges by the tokens' scores, after a space is put
before each run of text that starts the prompt or follows a special token. Special tokens are split
out of the text here rather than by HF's added-token matcher, because llama.cpp's rule differs:
longer special texts are tried first over the whole text, and user-defined tokens are split out even
when special tokens are not parsed.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from strata.errors import ModelFormatError
from strata.model.pretokenize import PreTokenizer, pre_tokenizer_for
from strata.model.spm import SPACE_MARK, SpmModel
from strata.model.special_tokens import (
    SpecialTokens,
    TokenAttr,
    attrs_from_types,
    resolve_special_tokens,
)

# tokenizer.ggml.model -> what it is
SUPPORTED_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
# a BPE vocabulary without BOS/EOS keys gets id 11 for both, SentencePiece 1 and 2 (llama.cpp's defaults)
_DEFAULT_BOS_EOS = {"gpt2": (11, 11), "llama": (1, 2)}
_RENDERED_AS_TEXT = TokenAttr.UNKNOWN | TokenAttr.CONTROL | TokenAttr.USER_DEFINED
_SPECIAL = TokenAttr.UNKNOWN | TokenAttr.CONTROL


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_of_char()
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _BYTE_OF_CHAR.items()})
_NOT_BYTE_CHAR = re.compile("[^" + "".join(re.escape(c) for c in _BYTE_OF_CHAR) + "]")


class Tokenizer:
    """Encode and decode with one GGUF vocabulary. Build it with `Tokenizer.from_metadata`.

    `encode_batch` turns raw texts (no special tokens in them) into ids. `is_add_space_prefix`
    (SentencePiece) puts a space before each raw text that starts the prompt or follows a special
    token, and `decode` drops one leading space of the first token's text again.
    """

    def __init__(self, encode_batch: Callable[[list[str]], list[list[int]]], texts: Sequence[str],
                 special: SpecialTokens, *, is_byte_level: bool, is_add_space_prefix: bool, is_add_bos: bool,
                 is_add_eos: bool, chat_template: str | None):
        self._encode_batch = encode_batch
        self._texts = tuple(texts)
        self._attrs = special.attrs
        self._special = special
        self._pieces = tuple(_piece(t, a, is_byte_level) for t, a in zip(self._texts, self._attrs))
        self._split_table = _split_table(self._texts, self._attrs)
        self.max_token_bytes = max((len(p) for p in self._pieces), default=1)  # no token covers more text
        self.is_add_space_prefix = is_add_space_prefix
        self.is_add_bos = is_add_bos
        self.is_add_eos = is_add_eos
        self.chat_template = chat_template

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        if model not in SUPPORTED_MODELS:
            supported = ", ".join(f"{name} ({kind})" for name, kind in SUPPORTED_MODELS.items())
            found = "missing" if model is None else f"{model!r}, a vocabulary type Strata does not support"
            raise ModelFormatError(
                f"tokenizer.ggml.model is {found}; supported: {supported}. "
                "Use a GGUF of a model with one of those vocabularies"
            )
        texts = [t or f"[EMPTY_{i}]" for i, t in enumerate(_required(metadata, "tokenizer.ggml.tokens", model))]
        types = attrs_from_types(metadata.get("tokenizer.ggml.token_type"), len(texts))
        special = resolve_special_tokens(metadata, texts, types, _DEFAULT_BOS_EOS[model])
        if model == "llama":
            encode_batch = SpmModel(texts, _required(metadata, "tokenizer.ggml.scores", model)).encode_batch
            is_add_space_prefix, is_add_bos = True, True
        else:
            pre = pre_tokenizer_for(metadata.get("tokenizer.ggml.pre"))
            encode_batch = _bpe_encoder(texts, _required(metadata, "tokenizer.ggml.merges", model), pre)
            is_add_space_prefix, is_add_bos = False, pre.is_add_bos
        return cls(
            encode_batch, texts, special, is_byte_level=model == "gpt2",
            is_add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", is_add_space_prefix)),
            is_add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", is_add_bos)),
            is_add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    @property
    def bos_id(self) -> int | None:
        return self._special.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._special.eos_id

    @property
    def eot_id(self) -> int | None:
        return self._special.eot_id

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._special.eog_ids

    @property
    def control_texts(self) -> tuple[str, ...]:
        """Texts of the control and unknown tokens, which `parse_special` turns into their tokens
        (longest first)."""
        return tuple(text for text, _, is_special in self._split_table if is_special)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._special.eog_ids

    def is_special(self, token_id: int) -> bool:
        """A control or unknown token: rendered as its text by `decode` unless `skip_special`."""
        return bool(self._attrs[self._checked(token_id)] & _SPECIAL)

    def encode(self, text: str, *, add_bos: bool | None = None, add_eos: bool | None = None,
               parse_special: bool = False) -> list[int]:
        """Token ids of `text`. `add_bos`/`add_eos` None follow the metadata's rule; `parse_special`
        turns control-token texts such as `<|im_start|>` into their tokens instead of plain text."""
        return self.encode_segments([(text, parse_special)], add_bos=add_bos, add_eos=add_eos)

    def encode_segments(self, segments: Iterable[tuple[str, bool]], *, add_bos: bool | None = None,
                        add_eos: bool | None = None) -> list[int]:
        """Token ids of the segments' texts joined, each segment with its own `parse_special`: text
        in a segment that does not parse them stays plain text whatever its neighbours parse. Plain
        text that runs across segments is encoded as one text, as `encode` would.

        By the metadata's rule (`add_bos`/`add_eos` None), parsed text that already starts with the
        BOS token (a chat template's `bos_token`) gets no second one, nor a second EOS at its end:
        llama.cpp's chat path strips those texts from the rendered template for the same reason."""
        fragments = _joined([fragment for text, parse_special in segments
                             for fragment in _split_special(text, self._split_table, parse_special)])
        raw = [f for f in fragments if isinstance(f, str)]
        if self.is_add_space_prefix:
            # every raw text starts the prompt or follows a token: _joined leaves no two side by side
            raw = [" " + f for f in raw]
        encoded = iter(self._encode_batch(raw) if raw else ())
        is_bos = _pick(add_bos, self.is_add_bos and fragments[:1] != [self.bos_id])
        is_eos = _pick(add_eos, self.is_add_eos and fragments[-1:] != [self.eos_id])
        ids = [self._required_id(self.bos_id, "BOS")] if is_bos else []
        for fragment in fragments:
            ids.extend(next(encoded) if isinstance(fragment, str) else (fragment,))
        if is_eos:
            ids.append(self._required_id(self.eos_id, "EOS"))
        return ids

    def token_piece(self, token_id: int) -> bytes:
        """The bytes this token stands for; a special token's piece is its text."""
        return self._pieces[self._checked(token_id)]

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of the ids, as llama.cpp's `detokenize`: bytes that are not valid UTF-8 become U+FFFD,
        and with `is_add_space_prefix` the first token's text loses one leading space."""
        pieces = [self._decoded_piece(i, skip_special) for i in ids]
        if self.is_add_space_prefix and pieces:
            pieces[0] = pieces[0].removeprefix(b" ")
        return b"".join(pieces).decode("utf-8", errors="replace")

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        """Incremental text of ids that continue a prompt: each token's text in full, as llama.cpp's
        server streams it, so no space prefix is dropped."""
        return StreamDecoder(self, skip_special=skip_special)

    def _decoded_piece(self, token_id: int, skip_special: bool) -> bytes:
        piece = self.token_piece(token_id)
        return b"" if skip_special and self._attrs[token_id] & _SPECIAL else piece

    def _checked(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._texts):
            raise ModelFormatError(f"token id {token_id} is outside the vocabulary (0..{len(self._texts) - 1})")
        return token_id

    def _required_id(self, token_id: int | None, name: str) -> int:
        if token_id is None:
            raise ModelFormatError(f"a {name} token was requested but the vocabulary has none")
        return token_id


class StreamDecoder:
    """Token ids in, text out as soon as it is complete UTF-8: a character split over several tokens
    is held back until its last byte arrives. `flush` at the end releases what is left."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer._decoded_piece(token_id, self._skip_special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _pick(requested: bool | None, rule: bool) -> bool:
    return rule if requested is None else requested


def _required(metadata: Mapping[str, Any], key: str, model: str) -> list[Any]:
    value = metadata.get(key)
    if not isinstance(value, list):
        raise ModelFormatError(
            f"{key} is missing or not an array; a {model} ({SUPPORTED_MODELS[model]}) vocabulary needs it"
        )
    return value


def _bpe_encoder(texts: Sequence[str], merges: Sequence[str],
                 pre: PreTokenizer) -> Callable[[list[str]], list[list[int]]]:
    hf = _bpe(texts, merges, pre)

    def encode_batch(raw: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in hf.encode_batch(raw, add_special_tokens=False)]

    return encode_batch


def _bpe(texts: Sequence[str], merges: Sequence[str], pre: PreTokenizer) -> HFTokenizer:
    # a token text that is not valid UTF-8 (kept by surrogateescape) can never be produced by BPE
    vocab = {t: i for i, t in enumerate(texts) if _is_utf8(t)}
    model = models.BPE(vocab=vocab, merges=_merge_pairs(merges, vocab), ignore_merges=pre.is_ignore_merges)
    hf = HFTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    return hf


def _merge_pairs(merges: Sequence[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """llama.cpp splits a merge at the first space after position 0, and the first rank of a pair wins.
    HF refuses pairs whose parts or result are not in the vocabulary; such a merge could only yield
    a symbol with no token id, so it is left out."""
    pairs, seen = [], set()
    for merge in merges:
        cut = merge.find(" ", 1)
        pair = (merge[:cut], merge[cut + 1:])
        if cut < 0 or pair in seen:
            continue
        seen.add(pair)
        if pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab:
            pairs.append(pair)
    return pairs


def _split_table(texts: Sequence[str], attrs: Sequence[TokenAttr]) -> tuple[tuple[str, int, bool], ...]:
    """(text, id, is_special) of the tokens split out of text before BPE, longest text (in bytes) first."""
    ids = [i for i, a in enumerate(attrs) if a & _RENDERED_AS_TEXT]
    ids.sort(key=lambda i: (-len(texts[i].encode("utf-8", "surrogateescape")), i))
    return tuple((texts[i], i, bool(attrs[i] & _SPECIAL)) for i in ids)


def _split_special(text: str, table: Sequence[tuple[str, int, bool]], parse_special: bool) -> list[str | int]:
    """Raw-text fragments and special token ids, in order. Control and unknown tokens only count
    when `parse_special`; user-defined tokens always do."""
    fragments: list[str | int] = [text] if text else []
    for special_text, token_id, is_special in table:
        if is_special and not parse_special:
            continue
        if any(isinstance(f, str) and special_text in f for f in fragments):
            fragments = [part for f in fragments for part in _split_at(f, special_text, token_id)]
    return fragments


def _joined(fragments: list[str | int]) -> list[str | int]:
    """Adjacent raw-text fragments as one."""
    joined: list[str | int] = []
    run: list[str] = []
    for fragment in fragments:
        if isinstance(fragment, str):
            run.append(fragment)
            continue
        if run:
            joined.append("".join(run))
            run = []
        joined.append(fragment)
    if run:
        joined.append("".join(run))
    return joined


def _split_at(fragment: str | int, special_text: str, token_id: int) -> list[str | int]:
    if not isinstance(fragment, str):
        return [fragment]
    first, *rest = fragment.split(special_text)
    parts: list[str | int] = [first] if first else []
    for part in rest:
        parts.append(token_id)
        if part:
            parts.append(part)
    return parts


def _piece(text: str, attr: TokenAttr, is_byte_level: bool) -> bytes:
    """llama.cpp's `token_to_piece` with specials rendered: text of special and user-defined tokens,
    byte-level decoding (BPE) or ▁ as space (SentencePiece) of normal ones, the byte of a `<0xXX>`
    byte token, nothing for the rest."""
    if attr & _RENDERED_AS_TEXT:
        return text.encode("utf-8", "surrogateescape")
    if attr & TokenAttr.NORMAL:
        return _byte_level_decode(text) if is_byte_level else text.replace(SPACE_MARK, " ").encode(
            "utf-8", "surrogateescape")
    if attr & TokenAttr.BYTE:
        if not re.fullmatch("<0x[0-9A-Fa-f]{2}>", text):
            raise ModelFormatError(f"byte token {text!r} is not of the form <0xXX>")
        return bytes([int(text[3:5], 16)])
    return b""


def _byte_level_decode(text: str) -> bytes:
    if not _NOT_BYTE_CHAR.search(text):
        return text.translate(_TO_LATIN1).encode("latin-1")
    raw = text.encode("utf-8", "surrogateescape")
    # llama.cpp's rendering of a character outside the byte-level alphabet
    return b"".join(
        bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR
        else b"[UNK_BYTE_0x" + c.encode("utf-8", "surrogateescape").hex().encode() + raw + b"]"
        for c in text
    )


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

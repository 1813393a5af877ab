"""SentencePiece (`tokenizer.ggml.model = "llama"`) vocabularies: llama.cpp's `ggml-vocab-llama-spm`
vectors from the copy in tests/data, the BOS and space-prefix rules, the score-driven merge, byte
fallback, and a chat prompt whose template writes the BOS token."""

import random

import pytest
import vocab_vectors as vv

from strata.cli.generate import encode_prompt
from strata.errors import ModelFormatError
from strata.model.chat import render_chat
from strata.model.tokenizer import Tokenizer

LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def spm_metadata():
    return vv.tokenizer_metadata(vv.bundled_vocab_path("llama-spm"))


@pytest.fixture(scope="module")
def spm(spm_metadata):
    return Tokenizer.from_metadata(spm_metadata)


def _id(metadata, text):
    """The id of the token whose text (▁ for space) is `text`."""
    return metadata["tokenizer.ggml.tokens"].index(text)


# ---- llama.cpp's vectors ----------------------------------------------------------------------


def test_llama_spm_vectors(spm):
    vectors = vv.read_vectors_at(vv.bundled_vocab_path("llama-spm"))
    assert len(vectors) >= 40
    wrong = [(text, ids, got) for text, ids in vectors.items() if (got := spm.encode(text, add_bos=False)) != ids]
    assert not wrong, f"{len(wrong)} of {len(vectors)} differ, first: {wrong[0]}"


def test_llama_spm_vectors_decode_back(spm):
    for text, ids in vv.read_vectors_at(vv.bundled_vocab_path("llama-spm")).items():
        assert spm.decode(ids) == text


# ---- rules from the metadata ------------------------------------------------------------------


def test_bos_and_space_prefix_rules(spm, spm_metadata):
    assert spm_metadata["tokenizer.ggml.add_bos_token"] is True
    assert "tokenizer.ggml.add_space_prefix" not in spm_metadata  # the SentencePiece default applies
    assert spm.is_add_bos and spm.is_add_space_prefix and not spm.is_add_eos
    assert (spm.bos_id, spm.eos_id) == (1, 2)
    hello = _id(spm_metadata, "▁Hello")
    assert spm.encode("Hello") == [spm.bos_id, hello]
    assert spm.encode("Hello", add_bos=False) == [hello]
    assert spm.encode("") == [spm.bos_id]
    assert spm.decode([spm.bos_id, hello]) == "<s> Hello"  # llama.cpp drops the space of the first token only
    assert spm.decode([spm.bos_id, hello], skip_special=True) == " Hello"


def test_metadata_turns_the_rules_off(spm_metadata):
    plain = Tokenizer.from_metadata(spm_metadata | {"tokenizer.ggml.add_bos_token": False,
                                                    "tokenizer.ggml.add_space_prefix": False})
    assert not plain.is_add_bos and not plain.is_add_space_prefix
    ids = plain.encode("Hello world")
    assert plain.bos_id not in ids and ids[0] == _id(spm_metadata, "Hello")
    assert plain.decode(plain.encode(" Hello")) == " Hello"


def test_space_prefix_after_every_special_token(spm, spm_metadata):
    hello, hi = _id(spm_metadata, "▁Hello"), _id(spm_metadata, "▁Hi")
    assert spm.encode("<s>Hello</s>Hi", add_bos=False, parse_special=True) == [1, hello, 2, hi]
    assert 1 not in spm.encode("<s>Hello", add_bos=False)  # not parsed: the text <s>
    assert spm.decode(spm.encode("<s>Hello</s>", add_bos=False)) == "<s>Hello</s>"


def test_byte_fallback_and_streaming(spm, spm_metadata):
    ids = spm.encode("🦙", add_bos=False)
    byte_tokens = [_id(spm_metadata, f"<0x{b:02X}>") for b in "🦙".encode()]
    assert ids == [_id(spm_metadata, "▁"), *byte_tokens]
    stream = spm.stream_decoder()
    assert [stream.feed(i) for i in ids] == [" ", "", "", "", "🦙"]
    assert stream.flush() == "" and spm.decode(ids) == "🦙"


def test_stream_decoder_matches_pieces_on_arbitrary_ids(spm):
    rng = random.Random(11)
    for _ in range(20):
        ids = [rng.randrange(spm.vocab_size) for _ in range(rng.randrange(1, 60))]
        for skip_special in (False, True):
            stream = spm.stream_decoder(skip_special=skip_special)
            streamed = "".join(stream.feed(i) for i in ids) + stream.flush()
            pieces = b"".join(b"" if skip_special and spm.is_special(i) else spm.token_piece(i) for i in ids)
            assert streamed == pieces.decode("utf-8", errors="replace")


# ---- chat prompts -----------------------------------------------------------------------------


def test_chat_prompt_has_one_bos(spm_metadata):
    tokenizer = Tokenizer.from_metadata(spm_metadata | {"tokenizer.chat_template": LLAMA2_TEMPLATE})
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    rendered = render_chat(LLAMA2_TEMPLATE, messages, bos_token="<s>", eos_token="</s>")
    assert rendered.startswith("<s>[INST] Hi")
    ids = tokenizer.encode(rendered, parse_special=True)
    # as llama.cpp's chat path: the template's BOS text is dropped and the BOS rule adds it once
    assert ids == tokenizer.encode(rendered.removeprefix("<s>"), parse_special=True)
    assert ids.count(tokenizer.bos_id) == 1 and ids[0] == tokenizer.bos_id
    assert ids.count(tokenizer.eos_id) == 1
    assert ids[1:3] == [_id(spm_metadata, "▁["), _id(spm_metadata, "INST")]
    assert tokenizer.encode(rendered, parse_special=True, add_bos=True)[:2] == [tokenizer.bos_id] * 2
    cli_ids = encode_prompt(tokenizer, "Hi", is_chat=True).tolist()
    assert cli_ids == tokenizer.encode("[INST] Hi [/INST]")


# ---- the merge and its failures, on a small vocabulary ----------------------------------------


def _tiny_metadata(scores=None, **overrides):
    """`<unk> <s> </s>`, the byte tokens, then pieces with their scores (a higher score merges first)."""
    scores = scores or {"▁": -1.0, "a": -2.0, "b": -2.0, "c": -2.0, "ab": -3.0, "bc": -4.0, "abc": -5.0,
                        "aa": -6.0, "<u>": 0.0}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *scores]
    types = [2, 3, 3, *[6] * 256, *(4 if t == "<u>" else 1 for t in scores)]
    metadata = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [0.0] * 259 + list(scores.values()), "tokenizer.ggml.add_space_prefix": False,
    }
    return metadata | overrides


def _encoded_texts(metadata, text):
    """The token texts `text` encodes to with the vocabulary of `metadata`, without BOS."""
    ids = Tokenizer.from_metadata(metadata).encode(text, add_bos=False)
    return [metadata["tokenizer.ggml.tokens"][i] for i in ids]


def test_highest_score_merges_first_and_equal_scores_leftmost():
    metadata = _tiny_metadata()
    assert _encoded_texts(metadata, "abc") == ["abc"]
    assert _encoded_texts(metadata, "abbc") == ["ab", "bc"]
    assert _encoded_texts(metadata, "aaa") == ["aa", "a"]
    assert _encoded_texts(_tiny_metadata({"a": -2.0, "b": -2.0, "c": -2.0, "ab": -3.0, "bc": -1.0}), "abc") == \
        ["a", "bc"]
    assert _encoded_texts(_tiny_metadata({"a": -2.0, "b": -2.0, "c": -2.0, "ab": -1.0, "bc": -3.0}), "abc") == \
        ["ab", "c"]


def test_unknown_characters_fall_back_to_bytes_and_user_tokens_restart_the_prefix():
    metadata = _tiny_metadata(**{"tokenizer.ggml.add_space_prefix": True})
    assert _encoded_texts(metadata, "ab é") == ["▁", "ab", "▁", "<0xC3>", "<0xA9>"]
    assert _encoded_texts(metadata, "a<u>b") == ["▁", "a", "<u>", "▁", "b"]
    tokenizer = Tokenizer.from_metadata(metadata)
    assert tokenizer.decode(tokenizer.encode("ab é", add_bos=False)) == "ab é"


def test_bad_spm_metadata_is_refused():
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores is missing.*llama \\(SentencePiece\\)"):
        Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.ggml.scores": None}))
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores has 3 entries"):
        Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.ggml.scores": [0.0] * 3}))
    no_bytes = {k: (v[:3] + v[259:] if isinstance(v, list) else v) for k, v in _tiny_metadata().items()}
    assert _encoded_texts(no_bytes, "ab") == ["ab"]
    with pytest.raises(ModelFormatError, match="'é' is not in the vocabulary.*no byte token <0xC3>"):
        Tokenizer.from_metadata(no_bytes).encode("é")


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv"])
def test_unsupported_vocabulary_types_are_named(model):
    with pytest.raises(ModelFormatError, match=f"tokenizer.ggml.model is '{model}', a vocabulary type Strata does "
                                               r"not support; supported: gpt2 \(byte-level BPE\), llama "
                                               r"\(SentencePiece\)"):
        Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.ggml.model": model}))

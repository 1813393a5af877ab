"""Pre-tokenizer regexes per `tokenizer.ggml.pre` value, as llama.cpp's `src/llama-vocab.cpp` assigns them.

A byte-level BPE vocabulary only reproduces llama.cpp's tokens when the text is first split exactly
as llama.cpp splits it: each regex of the list splits every piece left by the previous one, the
matches and the gaps between them both kept as pieces. The regexes are llama.cpp's adapted forms
(case-insensitive contractions spelled out), not the originals from the models' tokenizer.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ModelFormatError

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35_REGEX = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp treats one family of `tokenizer.ggml.pre` values."""

    regexes: tuple[str, ...]
    # a whole pre-token found in the vocabulary is taken as one token without applying merges
    is_ignore_merges: bool = False
    # BOS added by default; `tokenizer.ggml.add_bos_token` overrides when present
    is_add_bos: bool = False


_LLAMA3 = PreTokenizer((LLAMA3_REGEX,), is_ignore_merges=True, is_add_bos=True)
_LLAMA3_SPLIT_ONLY = PreTokenizer((LLAMA3_REGEX,))
_QWEN2 = PreTokenizer((QWEN2_REGEX,))
_QWEN35 = PreTokenizer((QWEN35_REGEX,))
_STARCODER = PreTokenizer((r"\p{N}", GPT2_REGEX))
_GPT2 = PreTokenizer((GPT2_REGEX,))
_FALCON = PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, "[0-9][0-9][0-9]"))
_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"))
_DEEPSEEK_CODER = PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"))
_DEEPSEEK_LLM = PreTokenizer(
    (
        "[\r\n]",
        _DEEPSEEK_LLM_LETTERS,
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK_HANGUL,
        r"\p{N}+",
    )
)

# compared with llama.cpp on a real vocabulary under each of their names: tools/peer-tokens. Not here: superbpe
# (its \d is ASCII in llama.cpp's std::regex, any decimal digit here), jina-v2-de / jina-v2-es (llama.cpp
# also strips the space before their <mask>)
_BAILINGMOE = PreTokenizer(
    (
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
        ' ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+',
    )
)
_BLOOM = PreTokenizer((' ?[^(\\s|.,!?…。，、।۔،)]+',))
_CHAMELEON = PreTokenizer(
    (
        '<sentinel:[0-9]+>',
        '(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z',
        '([\\t\\n]|    |  )',
        '\\p{N}',
        '[\\p{P}!-/:-@\\[-`{-~]',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ), is_add_bos=True
)
_DEEPSEEK_V3 = PreTokenizer(
    (
        '\\p{N}{1,3}',
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|'
        '[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|'
        '\\s+(?!\\S)|\\s+',
    )
)
_EXAONE_MOE = PreTokenizer(
    (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
        '[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}|'
        ' ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+',
    )
)
_GPT_4O = PreTokenizer(
    (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|"
        "'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|"
        "'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|"
        '\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    )
)
_GRANITE_EMBED_MULTI_97M = PreTokenizer(
    (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|"
        "'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|"
        "'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}|"
        ' ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ), is_ignore_merges=True
)
_JAIS_2 = PreTokenizer(
    (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
        '\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|'
        '\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|'
        '\\s{1,2}(?!\\S)|\\s{1}',
    )
)
_MINICPM5 = PreTokenizer(
    (
        '\\p{N}{1,3}',
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
        '\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ), is_ignore_merges=True
)
_SEED_CODER = PreTokenizer(
    (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
        '\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    )
)
_SPARK2_5 = PreTokenizer(
    (
        '\\p{N}{1,3}',
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|'
        '[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+',
        '\\p{N}',
    )
)
_TEKKEN = PreTokenizer(
    (
        '[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|'
        '[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}|'
        ' ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ), is_ignore_merges=True, is_add_bos=True
)
_UFAKZEKA = PreTokenizer(
    (
        '[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|'
        '\\s+(?!\\S)|\\s+',
    )
)
_VIKING = PreTokenizer((' ?[^(\\s|.,!?…。，、।۔،)]+', '\\p{N}'))

_FAMILIES: dict[PreTokenizer, tuple[str, ...]] = {
    _LLAMA3: ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
    _LLAMA3_SPLIT_ONLY: ("dbrx", "smaug-bpe"),
    _QWEN2: ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"),
    _QWEN35: ("qwen35",),
    _STARCODER: ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
    _GPT2: (
        "gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais", "trillion",
        "granite-docling", "jina-de", "jina-es", "modern-bert"),
    _FALCON: ("falcon",),
    _DEFAULT: ("default",),
    _DEEPSEEK_CODER: ("deepseek-coder",),
    _DEEPSEEK_LLM: ("deepseek-llm",),
    _BAILINGMOE: ("bailingmoe", "bailingmoe2", "llada-moe"),
    _BLOOM: ("bloom", "gpt3-finnish", "poro-chat"),
    _CHAMELEON: ("chameleon",),
    _DEEPSEEK_V3: ("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"),
    _EXAONE_MOE: ("exaone-moe",),
    _GPT_4O: ("gpt-4o", "kanana2", "llama4", "minimax-m2", "talkie"),
    _GRANITE_EMBED_MULTI_97M: ("granite-embed-multi-97m",),
    _JAIS_2: ("jais-2",),
    _MINICPM5: ("minicpm5",),
    _SEED_CODER: ("seed-coder",),
    _SPARK2_5: ("spark2_5",),
    _TEKKEN: ("tekken",),
    _UFAKZEKA: ("ufakzeka",),
    _VIKING: ("viking",),
}
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for pre, names in _FAMILIES.items() for name in names}


def pre_tokenizer_for(name: str | None) -> PreTokenizer:
    """The pre-tokenizer of a `tokenizer.ggml.pre` value; llama.cpp falls back to 'default' when absent."""
    if name is None or name == "":
        return _DEFAULT
    if name not in PRE_TOKENIZERS:
        supported = ", ".join(sorted(PRE_TOKENIZERS))
        raise ModelFormatError(f"tokenizer.ggml.pre is {name!r}, which Strata does not support; supported: {supported}")
    return PRE_TOKENIZERS[name]

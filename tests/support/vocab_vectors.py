"""llama.cpp's own tokenizer test vectors, taken from the llama-cpp-python source distribution on PyPI.

The sdist vendors llama.cpp with `models/ggml-vocab-<name>.gguf` (vocabulary-only GGUFs) and, for
most, `.gguf.inp` (inputs separated by a marker line) and `.gguf.out` (one line of space-separated
token ids per input), produced by llama.cpp's `test-tokenizer-0` with no BOS and special tokens not
parsed. It is downloaded once with pip into `.cache/` and only those files (and llama.cpp's
`src/llama-vocab.cpp`, to check the pre-tokenizer table against) are extracted.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import gguf

from strata.model import metadata as metadata_module

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".cache" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
VENDORED = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
WANTED = ("models/ggml-vocab-", "src/llama-vocab.cpp")
INPUT_SEPARATOR = "\n__ggml_vocab_test__\n"
# copies kept in the repository, so their vectors run without the download
BUNDLED_DIR = REPO_ROOT / "tests" / "data"


class VectorsUnavailable(Exception):
    """The sdist could not be downloaded or read; the tests that need it skip with this reason."""


def llama_cpp_dir() -> Path:
    """The extracted `vendor/llama.cpp` subset, downloading and extracting it on first use."""
    target = CACHE_DIR / "llama.cpp"
    if (target / "src" / "llama-vocab.cpp").is_file():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as scratch:
        sdist = _download_sdist(Path(scratch))
        staged = Path(scratch) / "llama.cpp"
        _extract(sdist, staged)
        if not target.exists():  # another process may have won the race; its copy is identical
            staged.rename(target)
    return target


def vocab_path(name: str) -> Path:
    return llama_cpp_dir() / "models" / f"ggml-vocab-{name}.gguf"


def vocab_names_with_vectors() -> list[str]:
    models = llama_cpp_dir() / "models"
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in models.glob("ggml-vocab-*.gguf.inp"))


def bundled_vocab_path(name: str) -> Path:
    """A vocabulary GGUF with its vectors under tests/data, the same bytes as the sdist's."""
    return BUNDLED_DIR / f"ggml-vocab-{name}.gguf"


def read_vectors(name: str) -> dict[str, list[int]]:
    """Input text -> expected ids, read as `test-tokenizer-0` reads them (a repeated input keeps its last ids)."""
    return read_vectors_at(vocab_path(name))


def read_vectors_at(gguf_path: Path) -> dict[str, list[int]]:
    """The vectors beside `gguf_path` (`.inp`, `.out`)."""
    raw = Path(f"{gguf_path}.inp").read_bytes().decode("utf-8")
    inputs = raw.split(INPUT_SEPARATOR)
    if inputs and inputs[-1] == "":
        inputs.pop()
    outputs = Path(f"{gguf_path}.out").read_bytes().decode("utf-8").split("\n")
    if outputs and outputs[-1] == "":
        outputs.pop()
    if len(inputs) != len(outputs):
        raise ValueError(f"{gguf_path}: {len(inputs)} inputs but {len(outputs)} outputs")
    return {text: [int(t) for t in line.split()] for text, line in zip(inputs, outputs)}


def tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The `tokenizer.*` keys of a GGUF as `read_metadata` returns them, cached as JSON: opening these
    files with `gguf.GGUFReader` takes seconds each. The cache key covers the reader's source."""
    reader_hash = hashlib.sha256(inspect.getsource(metadata_module).encode()).hexdigest()[:16]
    cached = CACHE_DIR / "metadata" / f"{path.name}.{path.stat().st_size}.{reader_hash}.json"
    if cached.is_file():
        return json.loads(cached.read_text(encoding="utf-8"))
    found = metadata_module.read_metadata(gguf.GGUFReader(path))
    wanted = {k: v for k, v in found.items() if k.startswith("tokenizer.")}
    cached.parent.mkdir(parents=True, exist_ok=True)
    scratch = cached.with_suffix(".tmp")
    scratch.write_text(json.dumps(wanted), encoding="utf-8")  # ASCII escapes keep surrogates intact
    scratch.replace(cached)
    return wanted


def llama_cpp_pre_tokenizers() -> dict[str, tuple[tuple[str, ...], bool, bool, str]]:
    """`tokenizer.ggml.pre` value -> (regexes, ignore_merges, add_bos, any other setting it changes),
    read from llama.cpp's `src/llama-vocab.cpp`: the regex lists by pre-type from the BPE tokenizer's
    switch, the pre-types and flags by name from the vocabulary loader's if/else chain."""
    source = (llama_cpp_dir() / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    switch = source[source.index("struct llm_tokenizer_bpe : llm_tokenizer"):]
    switch = switch[: switch.index("std::vector<std::string> regex_exprs;")]
    regexes_of_type = {}
    for case in re.finditer(r"((?:\s*case LLAMA_VOCAB_PRE_TYPE_\w+:)+|\s*default:)(.*?)break;", switch, re.S):
        code = re.sub(r"//[^\n]*", "", case.group(2))
        regexes = tuple(_c_string(lit) for lit in re.findall(r'"((?:[^"\\]|\\.)*)"', code))
        for pre_type in re.findall(r"LLAMA_VOCAB_PRE_TYPE_(\w+)", case.group(1)) or ["DEFAULT"]:
            regexes_of_type[pre_type] = regexes
    chain = source[source.index('tokenizer_pre == "default"') - 200: source.index("unknown pre-tokenizer type")]
    found = {}
    for branch in re.finditer(r"if \((.*?)\) \{\s*pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);(.*?)\} else", chain, re.S):
        settings = branch.group(3)
        other = sorted(set(re.findall(r"(\w+) =", settings)) - {"ignore_merges", "add_bos", "clean_spaces"})
        flags = (regexes_of_type[branch.group(2)], "ignore_merges = true" in settings, "add_bos = true" in settings)
        for name in re.findall(r'tokenizer_pre == "([^"]+)"', branch.group(1)):
            found[name] = (*flags, ", ".join(other))
    return found


def _c_string(literal: str) -> str:
    """A C++ string literal's value (its escapes resolved; the rest is UTF-8 source text)."""
    return literal.encode("utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")


def _download_sdist(dest: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
        "--dest", str(dest), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise VectorsUnavailable(f"pip download of llama-cpp-python failed: {error}") from error
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not found:
        tail = ((done.stderr or done.stdout).strip().splitlines() or [""])[-1][:300]
        raise VectorsUnavailable(f"pip download of llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} failed: {tail}")
    return found[0]


def _extract(sdist: Path, dest: Path) -> None:
    try:
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                inner = member.name.removeprefix(VENDORED)
                is_wanted = inner != member.name and inner.startswith(WANTED) and ".." not in Path(inner).parts
                if member.isfile() and is_wanted:
                    out = dest / inner
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with archive.extractfile(member) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst)
    except (OSError, tarfile.TarError) as error:
        raise VectorsUnavailable(f"{sdist.name} could not be read: {error}") from error
    if not (dest / "src" / "llama-vocab.cpp").is_file():
        raise VectorsUnavailable(f"{sdist.name} does not hold vendor/llama.cpp/src/llama-vocab.cpp")

"""Strata's tokenizer against llama.cpp's on one real vocabulary under each pre-tokenizer name.

usage: python compare.py TOKENIZE_BIN VOCAB.gguf INPUTS_DIR OUT_DIR [PRE_NAME ...]   (run.sh builds TOKENIZE_BIN)

VOCAB.gguf (a byte-level BPE vocabulary, e.g. llama.cpp's models/ggml-vocab-llama-bpe.gguf) is copied once
per pre-tokenizer name with ``tokenizer.ggml.pre`` set to it; every input of INPUTS_DIR's ``*.inp`` files
(llama.cpp's tokenizer test inputs, separated by ``__ggml_vocab_test__`` lines) and ``*.txt`` files is
tokenized by TOKENIZE_BIN (``tokenize.cpp``: llama.cpp, no BOS, special tokens as text) and by Strata.
Names without arguments: every name Strata knows. Prints a Markdown table: inputs, equal, the first that
differs.
"""

import subprocess
import sys
from pathlib import Path

import gguf

from strata.errors import ModelFormatError
from strata.model.metadata import read_metadata
from strata.model.tokenizer import Tokenizer

SEPARATOR = "\n__ggml_vocab_test__\n"


def inputs_of(directory: Path) -> list[str]:
    texts = []
    for path in sorted(directory.glob("*.inp")):
        texts += path.read_bytes().decode("utf-8").split(SEPARATOR)  # as bytes: a \r stays a \r
    texts += [path.read_bytes().decode("utf-8") for path in sorted(directory.glob("*.txt"))]
    return list(dict.fromkeys(t for t in texts if t))


def with_pre(src: Path, dst: Path, name: str) -> Path:
    reader = gguf.GGUFReader(src)
    metadata = read_metadata(reader)
    writer = gguf.GGUFWriter(dst, metadata["general.architecture"])
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = name if key == "tokenizer.ggml.pre" else metadata[key]
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main(argv: list[str]) -> int:
    binary, vocab, inputs_dir, out_dir = Path(argv[0]), Path(argv[1]), Path(argv[2]), Path(argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = inputs_of(inputs_dir)
    joined = out_dir / "inputs.txt"
    joined.write_bytes(SEPARATOR.join(texts).encode("utf-8"))
    from strata.model.pretokenize import PRE_TOKENIZERS

    names = argv[4:] or sorted(PRE_TOKENIZERS)
    print(f"{len(texts)} inputs, vocabulary {vocab.name}\n")
    print("| tokenizer.ggml.pre | equal | first input that differs |")
    print("| --- | ---: | --- |")
    for name in names:
        path = with_pre(vocab, out_dir / f"vocab-{name}.gguf", name)
        lines = subprocess.run([str(binary), str(path), str(joined)], check=True, capture_output=True,
                               text=True).stdout.split("\n")
        theirs = [[int(t) for t in line.split()] for line in lines[:len(texts)]]
        try:
            tokenizer = Tokenizer.from_metadata(read_metadata(gguf.GGUFReader(path)))
        except ModelFormatError:
            print(f"| {name} | refused by Strata | |")
            continue
        ours = [tokenizer.encode(text, add_bos=False, add_eos=False) for text in texts]
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        first = repr(texts[differ[0]][:40]) if differ else ""
        print(f"| {name} | {len(texts) - len(differ)}/{len(texts)} | {first} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

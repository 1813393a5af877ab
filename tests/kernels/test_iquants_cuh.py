"""cuda/iquants.cuh's tables against ggml's (strata.model.iquant_tables, itself checked against gguf-py's): the
IQ4 levels as iq4_levels picks them for every nibble (compiled for the CPU with g++), the IQ3_XXS grid whole (the
kernels' lane tests draw indices at random, which can miss an entry)."""

import subprocess

import numpy as np
from host_cpp import BYTE_PERM_SHIM, HALF_SHIMS, between, build

from strata.gpu.kernels import tensor_core
from strata.model.iquant_tables import IQ2S_GRID, IQ3S_GRID, IQ3XXS_GRID, KVALUES_IQ4NL

_MAIN = r"""
// every nibble 0 .. 15, four at a time (one a byte): the level bytes iq4_levels gives, in nibble order
int main() {
  for (unsigned n = 0; n < 16; n += 4) {
    const unsigned levels = iq4_levels(n | (n + 1) << 8 | (n + 2) << 16 | (n + 3) << 24);
    for (int k = 0; k < 4; ++k) printf("%d\n", (int)(signed char)(levels >> (8 * k)));
  }
  return 0;
}
"""


def test_iq4_levels_picks_ggmls_level_for_every_nibble(tmp_path):
    header = tensor_core.source_text("iquants.cuh")
    popc = "static inline int __popc(unsigned v) { return __builtin_popcount(v); }"
    source = "\n".join([HALF_SHIMS, BYTE_PERM_SHIM, popc,
                        between(header, "// IQ4_XS: byte i of the result", "}  // namespace"), _MAIN])
    build(tmp_path, "levels", source)
    done = subprocess.run([str(tmp_path / "levels")], capture_output=True, text=True, check=True)
    assert [int(line) for line in done.stdout.split()] == [int(v) for v in KVALUES_IQ4NL]


def test_the_iq3_xxs_grid_is_ggmls():
    table = between(tensor_core.source_text("iquants.cuh"), "kIq3XxsGrid[256] = {", "};")
    entries = [int(word.strip().rstrip("u"), 16) for word in table.split("{", 1)[1].split(",") if word.strip()]
    assert entries == [int(v) for v in IQ3XXS_GRID]
    assert np.asarray(IQ3XXS_GRID).shape == (256,)


def _table_words(name: str) -> list:
    table = between(tensor_core.source_text("iquants.cuh"), f"{name}[", "};")
    return [int(word.strip().rstrip("u"), 16) for word in table.split("{", 1)[1].split(",") if word.strip()]


def test_the_iq3_s_and_iq2_s_grids_are_ggmls():
    assert _table_words("kIq3SGrid") == [int(v) for v in IQ3S_GRID]
    assert _table_words("kIq2SGrid") == [int(v) for v in np.asarray(IQ2S_GRID, np.uint64).view(np.uint32)]
    assert len(_table_words("kIq3SGrid")) == 512 and len(_table_words("kIq2SGrid")) == 2 * 1024


"""The C++ rows' activation-row instantiations compile: what gemv_native appends to cuda/gemv_rows.cu for
a launch of several rows of x (the simulator cannot link C++, so without a GPU nvcc checks the source,
where it is installed)."""

import shutil
import subprocess

import pytest

from strata.backend.ops import DECODE_MAX_ROWS
from strata.gpu.kernels import gemv_native, tensor_core


def _loop_instance(fmt: str, rows_per_warp: int, num_x_rows: int) -> str:
    struct, unroll = gemv_native._LOOP_SHAPES[fmt]
    return (f"STRATA_GEMV_LOOP_X(strata_gemv_loop_x{num_x_rows}_{fmt.lower()}_r{rows_per_warp}, {struct}, "
            f"{rows_per_warp}, {unroll[rows_per_warp]}, {num_x_rows})\n")


def test_every_format_and_rows_shape_instantiates_for_several_rows_of_x(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    lines = []
    for rows_per_warp in (1, 2, 4):
        for num_x_rows in (2, DECODE_MAX_ROWS):
            lines.append(gemv_native._rows_instances(gemv_native.FORMATS, rows_per_warp, num_x_rows))
            lines.extend(_loop_instance(fmt, rows_per_warp, num_x_rows) for fmt in gemv_native.FORMATS)
    assert gemv_native._rows_instances(["Q4_0"], 2, 1) == ""  # one row: the source's own exports
    source = tmp_path / "gemv_rows_x.cu"
    source.write_text(tensor_core.source_text("gemv_rows.cu") + "".join(lines))
    done = subprocess.run(["nvcc", "-arch=sm_90", "-rdc=true", "-ptx", str(source), "-o", str(tmp_path / "x.ptx")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = (tmp_path / "x.ptx").read_text()
    for fmt in gemv_native.FORMATS:
        assert f".func strata_gemv_loop_x{DECODE_MAX_ROWS}_{fmt.lower()}_r4(" in ptx
        assert f".func strata_gemv_rows_x{DECODE_MAX_ROWS}_{fmt.lower()}_r4(" in ptx

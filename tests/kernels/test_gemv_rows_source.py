"""The C++ rows compile for every built format: cuda/gemv_rows.cu's own exports (one row of x, the experts'
gate/up pair and down loops, stacked and addressed) and what gemv_native appends to it for a launch of several rows
of x (the simulator cannot link C++, so without a GPU nvcc checks the source, where it is installed)."""

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
    # the served formats in every shape; those built but not yet served with the most rows of x only (nvcc takes
    # about half a second an instantiation)
    built_only = [fmt for fmt in gemv_native.BUILT_FORMATS if fmt not in gemv_native.FORMATS]
    lines = []
    for rows_per_warp in (1, 2, 4):
        for num_x_rows in (2, DECODE_MAX_ROWS):
            fmts = gemv_native.FORMATS + tuple(built_only if num_x_rows == DECODE_MAX_ROWS else ())
            lines.append(gemv_native._rows_instances(fmts, rows_per_warp, num_x_rows))
            lines.extend(_loop_instance(fmt, rows_per_warp, num_x_rows) for fmt in fmts)
    assert gemv_native._rows_instances(["Q4_0"], 2, 1) == ""  # one row: the source's own exports
    source = tmp_path / "gemv_rows_x.cu"
    source.write_text(tensor_core.source_text("gemv_rows.cu") + "".join(lines))
    done = subprocess.run(["nvcc", "-arch=sm_90", "-rdc=true", "-ptx", str(source), "-o", str(tmp_path / "x.ptx")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = (tmp_path / "x.ptx").read_text()
    for fmt in gemv_native.BUILT_FORMATS:
        suffix = fmt.lower()
        assert f".func strata_gemv_loop_x{DECODE_MAX_ROWS}_{suffix}_r4(" in ptx
        assert f".func strata_gemv_rows_x{DECODE_MAX_ROWS}_{suffix}_r4(" in ptx
        for rows_per_warp in (1, 2, 4):  # the source's own one-row exports
            assert f".func strata_gemv_loop_{suffix}_r{rows_per_warp}(" in ptx
            assert f".func strata_gemv_rows_{suffix}_r{rows_per_warp}(" in ptx
    for fmt in gemv_native.BUILT_EXPERT_FORMATS:
        assert f".func strata_pair_loop_{fmt.lower()}(" in ptx
        assert f".func strata_down_loop_{fmt.lower()}(" in ptx
        assert f".func strata_pair_loop_at_{fmt.lower()}(" in ptx  # the same over an address table (moe_addressed)
        assert f".func strata_down_loop_at_{fmt.lower()}(" in ptx
    assert set(gemv_native.FORMATS) <= set(gemv_native.BUILT_FORMATS)
    assert set(gemv_native.EXPERT_FORMATS) <= set(gemv_native.BUILT_EXPERT_FORMATS) <= set(gemv_native.BUILT_FORMATS)

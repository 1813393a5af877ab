import math

from strata.bench import kernels as bench


def test_kernel_benchmark_runs_at_toy_sizes(capsys):
    rows = bench.main(["--tiny"])
    table = capsys.readouterr().out
    names = [r.name for r in rows]
    for expected in ("decode GEMV Q4_0", "decode GEMV Q8_0", "decode GEMV Q4_K", "prefill experts Q4_0",
                     "decode GEMV Q4_0 64x256 at 3 rows of x",
                     "  gate and up alone", "  down alone",
                     "attention prefill", "attention decode F16", "attention decode Q8_0", "decode layer",
                     "decode token"):
        assert any(n.startswith(expected) for n in names), expected
    assert all(math.isfinite(r.figure) and r.figure > 0 for r in rows)
    launches = next(r for r in rows if r.name == "launches per decode token")
    assert launches.figure == bench.DECODE_LAUNCHES_PER_LAYER * bench.TINY.num_layers + bench.DECODE_LAUNCHES_OUTSIDE
    assert table.count("\n| ") == len(rows) + 2  # header, rule, one line per row


def test_a_dense_gemv_over_rows_of_x_is_timed_and_a_count_no_step_has_is_refused(capsys):
    import pytest

    row = bench.bench_gemv(bench.TINY, "Q8_0", 64, 256, bench.TINY_GEMV, False, (0, 1), num_x_rows=2)
    assert row.name == "decode GEMV Q8_0 64x256 at 2 rows of x, Numba" and math.isfinite(row.figure) and row.figure > 0
    assert bench._x_rows("2,5") == (2, 5) and bench._x_rows("0") == ()
    with pytest.raises(SystemExit):  # refused while parsing: nothing runs
        bench.main(["--tiny", "--x-rows", "1"])  # one row is the plain GEMV's own row
    assert "each count in 2..9" in capsys.readouterr().err


def test_variant_sweeps_refuse_without_tensor_cores():
    import pytest

    from strata.bench import variants
    from strata.gpu.kernels import tensor_core

    if tensor_core.is_available():
        pytest.skip("a GPU with tensor cores runs the sweeps for real")
    with pytest.raises(SystemExit, match="need a GPU with tensor cores"):
        variants.main([])


def test_variant_sweep_refuses_a_match_that_names_no_variant(capsys):
    import pytest

    from strata.bench import variants

    with pytest.raises(SystemExit) as exit_info:
        variants.main(["--only", "gemm", "--match", "fuzed"])
    assert exit_info.value.code == 2
    assert "--match 'fuzed' names no GEMM or MoE variant" in capsys.readouterr().err


def test_the_moe_sweep_takes_every_format_the_moe_prefill_rows_run():
    from strata.bench import variants
    from strata.gpu.kernels import moe_rows

    assert set(moe_rows.FORMATS) <= set(variants.WEIGHT_FORMATS)


def test_kernel_benchmark_takes_the_gemv_formats_and_refuses_an_unknown_one(capsys):
    import pytest

    rows = bench.main(["--tiny", "--gemv-formats", "IQ4_XS"])
    names = [r.name for r in rows]
    assert any(n.startswith("decode GEMV IQ4_XS") for n in names)
    assert not any(n.startswith("decode GEMV Q8_0") for n in names)
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--gemv-formats", "IQ5_XS"])
    assert "--gemv-formats: IQ5_XS not among" in capsys.readouterr().err


def test_the_zero_copy_benchmark_runs_at_toy_sizes(capsys):
    from strata.bench import zero_copy

    rows = zero_copy.main(["--tiny"])  # on a GPU it raises where host planes give other values than device ones
    names = [r.name for r in rows]
    assert names[0].startswith("DMA host→device, 4 KiB") and names[1].startswith("kernel reading pinned host memory")
    assert any("planes in device memory" in n for n in names)
    assert any("planes in pinned host memory" in n for n in names)
    assert all(math.isfinite(r.figure) and r.figure > 0 for r in rows)
    assert capsys.readouterr().out.count("\n| ") == len(rows) + 4  # two tables: the transfers', then the experts'


def test_timed_launches_rotate_over_weights_more_than_l2_apart(monkeypatch):
    import numpy as np

    monkeypatch.setattr(bench, "IS_SIMULATOR", False)  # the counts a GPU run takes
    mib = 2**20
    assert [bench.num_copies(n * mib) for n in (1, 5, 50, 128, 200)] == [128, 26, 3, 1, 1]
    assert [bench.num_launches(n) for n in (1, 26, 128)] == [bench.GRAPH_LAUNCHES, 26, 128]
    monkeypatch.setattr(bench, "IS_SIMULATOR", True)
    w = bench.random_packed("Q8_0", 4, 64, np.random.default_rng(1))
    copies = bench.packed_copies(w, 3)
    assert len(copies) == 3 and copies[1].quants is not w.quants
    assert all(np.array_equal(c.quants.copy_to_host(), w.quants.copy_to_host()) for c in copies)
    next_item = bench.rotating(["a", "b", "c"])
    assert [next_item() for _ in range(5)] == ["a", "b", "c", "a", "b"]
    shapes = bench.QWEN3_30B
    routings = [r.copy_to_host() for r in bench.routed_ids(shapes, 3, 9, np.random.default_rng(0))]
    assert all(r.shape == (3, shapes.top_k) for r in routings)
    assert all(len(set(row.tolist())) == shapes.top_k for r in routings for row in r)
    # one shuffle of 128 experts holds five routings of 24: those share no expert
    assert len({int(e) for r in routings[:5] for e in r.ravel()}) == 5 * 3 * shapes.top_k

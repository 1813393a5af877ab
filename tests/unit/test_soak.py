"""The soak command (run on a GPU for the record) on the numpy backend: its rows, slope and verdict."""

import ctypes
import json
import tracemalloc

import pytest
from serve_harness import write_tiny_model

from strata.bench.process_memory import PAGE_BYTES, heap_meter, heap_trimmer, rss_kinds
from strata.bench.soak import slope_bytes_per_request
from strata.cli import main


def test_the_slope_is_the_least_squares_growth_per_request():
    assert abs(slope_bytes_per_request([100, 100, 100])) < 1e-6
    assert abs(slope_bytes_per_request([0, 1024, 2048, 3072]) - 1024) < 1e-6
    assert slope_bytes_per_request([5]) == 0


def test_the_heap_trimmer_returns_the_c_heaps_free_pages_where_glibc_has_it():
    trim = heap_trimmer()
    if trim is None:
        pytest.skip("this C library has no malloc_trim")
    assert trim() in (0, 1)  # 1: memory was released


def test_a_soak_with_the_loan_on_records_every_request_and_passes_when_nothing_grows(tmp_path, capsys):
    model = write_tiny_model(tmp_path)
    config = tmp_path / "soak.toml"
    config.write_text(f'[model]\npath = "{model}"\n[runtime]\nbackend = "numpy"\nserve = true\n'
                      'vram_elastic = true\nvmm_segment = "64MiB"\nvram_budget = "512MiB"\ncontext_tokens = 512\n'
                      '[loan]\nenabled = true\nplugins = ["retain_startup_chunk", "repeat_loan"]\n'
                      '[loan.repeat_loan]\nmin_tokens = 256\n')
    out = tmp_path / "soak.jsonl"
    assert main(["--config", str(config), "soak", "--requests", "6", "--min-prompt", "8", "--max-prompt", "300",
                 "--gen-tokens", "2", "--settle", "2", "--trim-heap", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    rows, summary = lines[:-1], lines[-1]["summary"]
    assert [r["request"] for r in rows] == list(range(6)) and all(r["ledger_is_idle"] for r in rows)
    assert rows[0]["loan_taken"] and summary["loans_taken"] == sum(r["loan_taken"] for r in rows)
    assert summary["requests_not_idle"] == 0 and abs(summary["ledger_slope_bytes_per_request"]) < 1e-6
    assert summary["is_heap_trimmed"] == (heap_trimmer() is not None)
    printed = capsys.readouterr().out
    assert "slope over requests 2..5" in printed
    if heap_meter() is not None:  # glibc: the C heap's figures per request and their slopes
        assert all(r["heap_in_use_bytes"] > 0 and r["heap_free_bytes"] >= 0 for r in rows)
        assert "heap_free_slope_bytes_per_request" in summary and "C heap slope: in use" in printed
    assert all(r["python_blocks"] > 0 for r in rows) and "python_blocks_slope_blocks_per_request" in summary
    assert "the interpreter's allocated blocks: " in printed
    if rss_kinds():  # Linux: RSS by kind per request and their slopes
        assert all(r["rss_anon_bytes"] > 0 for r in rows) and "rss_anon_slope_bytes_per_request" in summary
        assert "RSS slope by kind, KiB/request: anonymous " in printed


def test_rss_kinds_reads_the_kernels_status_lines_in_bytes(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython3\nVmRSS:\t  1200 kB\nRssAnon:\t   1000 kB\nRssFile:\t    150 kB\n"
                      "RssShmem:\t     50 kB\nThreads:\t1\n")
    assert rss_kinds(str(status)) == {"rss_anon_bytes": 1000 * 1024, "rss_file_bytes": 150 * 1024,
                                      "rss_shmem_bytes": 50 * 1024}
    # without those lines (a sandboxed kernel's status file), statm's resident and shared pages
    (tmp_path / "bare").write_text("Name:\tpython3\nVmRSS:\t  1200 kB\n")
    (tmp_path / "statm").write_text("5000 300 100 10 0 900 0\n")
    assert rss_kinds(str(tmp_path / "bare"), str(tmp_path / "statm")) == {
        "rss_anon_bytes": 200 * PAGE_BYTES, "rss_file_or_shared_bytes": 100 * PAGE_BYTES}
    assert rss_kinds(str(tmp_path / "missing"), str(tmp_path / "missing")) == {}


def test_the_heap_meter_counts_a_block_malloc_hands_out_until_it_is_freed():
    heap = heap_meter()
    if heap is None:
        pytest.skip("this C library has no mallinfo2")
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    before = heap()
    block = libc.malloc(64 * 1024)  # below the mmap threshold: from the heap
    try:
        assert heap()["heap_in_use_bytes"] - before["heap_in_use_bytes"] >= 64 * 1024
    finally:
        libc.free(block)
    assert heap()["heap_in_use_bytes"] - before["heap_in_use_bytes"] < 64 * 1024


def test_python_growth_names_the_site_and_the_type_that_grew():
    from strata.bench.python_growth import PythonGrowth, format_report

    class Leaked:
        pass

    kept = []
    growth = PythonGrowth()
    was_tracing = tracemalloc.is_tracing()
    growth.start()
    kept.extend(Leaked() for _ in range(500))
    report = growth.report()
    assert tracemalloc.is_tracing() == was_tracing  # what it started, it stopped
    assert report["traced_bytes_gained"] > 0
    assert any(entry["type"].endswith("Leaked") and entry["objects"] >= 500 for entry in report["types"])
    assert any("test_soak.py" in frame for site in report["sites"] for frame in site["frames"])
    assert "Leaked" in format_report(report)


def test_the_object_census_names_the_type_that_grew_per_request():
    from strata.bench.python_growth import ObjectCensus, format_census

    class Kept:
        pass

    kept = []
    census = ObjectCensus()
    census.start()
    kept.extend(Kept() for _ in range(300))
    types = census.report(num_requests=3)
    entry = next(t for t in types if t["type"].endswith("Kept"))
    assert entry["objects"] == 300 and entry["per_request"] == 100
    assert "+100.0/request" in format_census(types, 0, 3)


class Held:  # a module's class: its census name is stable
    pass


class Holder:
    def __init__(self):
        self.held_items = []


def test_the_census_names_what_holds_the_objects_born_since_it_began():
    from strata.bench.python_growth import ObjectCensus, format_holders

    before = Held()  # alive at the start: not a sample
    holder = Holder()
    census = ObjectCensus()
    census.start()
    holder.held_items.extend(Held() for _ in range(5))
    name = f"{__name__}.Held"
    chains = census.holders(name, max_listed=2)
    assert len(chains) == 2
    for chain in chains:  # the object, the list, the holder
        assert chain.startswith("Held <- list of 5 <- Holder"), chain
    assert "held" in format_holders({name: chains}) and "none found" in format_holders({"x.Y": []})
    del before


def test_a_soak_with_the_census_prints_it_and_keeps_it_in_the_summary(tmp_path, capsys):
    rc, summary = _short_soak(tmp_path, "--requests", "5", "--settle", "2", "--census")
    assert rc == 0
    assert isinstance(summary["census"], list) and summary["slope_from_request"] == summary["census_from_request"] == 2
    printed = capsys.readouterr().out
    assert "live objects gained over 3 request(s) from request 2" in printed
    assert isinstance(summary["census_holders"], dict)  # what holds the two types past the interpreter's that grew


def test_a_soak_too_short_for_its_census_has_none_and_still_passes(tmp_path, capsys):
    # settling past the last request, the slope starts at the first one, where the process still grows (the RSS
    # slope of 3 requests read +286 KiB/request once): the bound is not what this test is about
    rc, summary = _short_soak(tmp_path, "--requests", "3", "--settle", "5", "--census", "--max-slope-kib", "65536")
    assert rc == 0
    assert "census" not in summary
    printed = capsys.readouterr()
    assert "live objects gained" not in printed.out and "--census: the soak ended before" in printed.err


def test_a_soak_can_trace_the_python_heap(tmp_path, capsys):
    config = _numpy_config(tmp_path)
    out = tmp_path / "soak.jsonl"
    assert main(["--config", str(config), "soak", "--requests", "6", "--min-prompt", "8", "--max-prompt", "64",
                 "--gen-tokens", "2", "--settle", "1", "--python-growth", "--python-growth-requests", "2",
                 "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["is_traced"] for row in lines[:-1]] == [False, True, True, False, False, False]
    summary = lines[-1]["summary"]
    assert set(summary["python_growth"]) == {"traced_bytes_gained", "sites", "types"}
    assert summary["slope_from_request"] == 3  # the traced requests' own memory is not in the slope
    assert "Python heap:" in capsys.readouterr().out


def test_a_soak_cut_short_still_writes_its_summary(tmp_path, monkeypatch):
    from strata.engine.facade import Engine

    config = _numpy_config(tmp_path)
    generate, calls = Engine.generate, []

    def generate_until_the_third(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what SIGTERM becomes during a soak
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", generate_until_the_third)
    out = tmp_path / "soak.jsonl"
    # two requests' RSS slope is noise (it was +84 KiB once): this test is about the summary, not the bound
    assert main(["--config", str(config), "soak", "--requests", "6", "--min-prompt", "8", "--max-prompt", "32",
                 "--gen-tokens", "2", "--settle", "0", "--max-slope-kib", "65536", "--out", str(out)]) == 0
    summary = json.loads(out.read_text().splitlines()[-1])["summary"]
    assert (summary["requests"], summary["is_interrupted"]) == (2, True)


def test_a_traced_window_past_the_last_request_still_reports_and_leaves_no_slope(tmp_path, capsys):
    # a window of 10 from request 1: no untraced request after it, so no slope, and the soak cannot pass
    rc, summary = _short_soak(tmp_path, "--requests", "4", "--settle", "1", "--python-growth")
    assert rc == 1
    printed = capsys.readouterr()
    assert "python_growth" in summary and "Python heap:" in printed.out
    assert summary["rss_slope_bytes_per_request"] is None and summary["device_slope_bytes_per_request"] is None
    assert "no slope: 0 request(s) from request 4 on, of 4 finished" in printed.err
    assert "slope over requests" not in printed.out


def _short_soak(tmp_path, *flags: str) -> tuple[int, dict]:
    """A soak of 8-32-token prompts and 2 generated tokens on ``_numpy_config`` with ``flags``: its exit
    status and the summary it wrote."""
    out = tmp_path / "soak.jsonl"
    rc = main(["--config", str(_numpy_config(tmp_path)), "soak", "--min-prompt", "8", "--max-prompt", "32",
               "--gen-tokens", "2", *flags, "--out", str(out)])
    return rc, json.loads(out.read_text().splitlines()[-1])["summary"]


def _numpy_config(tmp_path):
    """The tiny model on the numpy backend, a 512-token context."""
    config = tmp_path / "soak.toml"
    config.write_text(f'[model]\npath = "{write_tiny_model(tmp_path)}"\n[runtime]\nbackend = "numpy"\n'
                      'context_tokens = 512\n')
    return config


@pytest.mark.parametrize("flag, value", [("--requests", "-1"), ("--requests", "0"), ("--gen-tokens", "0"),
                                         ("--settle", "-2"), ("--min-prompt", "many")])
def test_a_count_out_of_range_is_refused_naming_its_flag(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(_numpy_config(tmp_path)), "soak", flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err

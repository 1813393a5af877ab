"""`strata bench` end to end on the numpy backend: fresh processes, both arms, the table, profiles."""

import argparse
import json
import pstats
import subprocess
import sys

import pytest

from engine_setup import LOAN_RUNTIME, write_small_moe

from strata.bench.harness import (
    decode_floor_seconds,
    decode_vram_bytes,
    format_table,
    host_busy_ms,
    prefill_floor_seconds,
    stderr_lines,
)
from strata.bench.provenance import code_identity


def _config(tmp_path, model):
    path = tmp_path / "bench.toml"
    runtime = {**LOAN_RUNTIME, "backend": "numpy"}
    lines = ["[model]", f'path = "{model}"', "[runtime]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in runtime.items()]
    lines += ["[planner]", "chunk_quantum_tokens = 16", "max_chunk_tokens = 32", "max_ring_slots = 16",
              "[loan]", "enabled = true", 'plugins = ["loan_mtp", "loan_head", "retain_startup_chunk", "repeat_loan"]']
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bench_runs_both_arms_in_fresh_processes_and_prints_the_table(tmp_path):
    model = write_small_moe(tmp_path / "small-moe-mtp.gguf", with_mtp=True)
    out, profiles = tmp_path / "runs.json", tmp_path / "profiles"
    done = subprocess.run([sys.executable, "-m", "strata.cli", "--config", str(_config(tmp_path, model)), "bench",
                           "--prompt-tokens", "40", "--gen-tokens", "3", "--reps", "1", "--arms", "off,on",
                           "--out", str(out), "--profile-dir", str(profiles)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert [(r["loan"], r["prompt_tokens"], r["generated_tokens"]) for r in runs] == [("off", 40, 3), ("on", 40, 3)]
    assert all(r["prefill_tokens_per_s"] > 0 and r["num_chunks"] == 2 for r in runs)
    # what a decode token reads from VRAM, for the decode floor's HBM term
    assert all(r["dense_read_bytes"] > 0 and r["head_read_bytes"] > 0 and r["expert_read_bytes"] > 0
               and r["kv_bytes_per_cell"] > 0 and decode_vram_bytes(r) > 0 for r in runs)
    # each run names the code it imported, the same as the harness's first line names
    code = code_identity()
    assert all(r["code"] == code for r in runs) and f"# {code}\n" in done.stderr
    assert " ran strata" not in done.stderr
    assert all(isinstance(r["stderr_lines"], list) for r in runs)
    assert all(f"[{r['loan']} 40 #1] said: {line}" in done.stderr for r in runs for line in r["stderr_lines"])
    assert "| 40 | off |" in done.stdout and "| 40 | on |" in done.stdout
    for name in ("off-config-40-1.prof", "on-config-40-1.prof"):
        assert pstats.Stats(str(profiles / name)).total_calls > 0


def test_bench_draft_oracle_labels_its_rows_and_plain_decode_arm_and_times_layers(tmp_path):
    model = write_small_moe(tmp_path / "small-moe-mtp.gguf", with_mtp=True)
    out = tmp_path / "runs.json"
    done = subprocess.run([sys.executable, "-m", "strata.cli", "--config", str(_config(tmp_path, model)), "bench",
                           "--prompt-tokens", "40", "--gen-tokens", "9", "--reps", "1", "--arms", "off",
                           "--spec", "fixed,off", "--draft-oracle", "1", "--layer-timeline", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fixed, plain = json.loads(out.read_text())
    assert (fixed["spec"], plain["spec"]) == ("fixed", "off")
    # every draft is the greedy continuation: each verify step takes all of its drafts
    assert fixed["spec_rounds"] and fixed["spec_accepted"] == fixed["spec_drafted"] > 0
    assert plain["spec_rounds"] == 0
    assert fixed["is_output_equal"] and fixed["first_difference"] is None  # the plain run's tokens
    assert "acceptance by place 1.00 1.00, last depth" in done.stderr and "OUTPUT DIFFERS" not in done.stderr
    # --layer-timeline: every prefill layer timed, in the JSON and the timing line
    assert all(r["prefill_layers"]["layers"] > 0 and r["prefill_forward_seconds"] > 0 for r in (fixed, plain))
    # loan off: the MTP block passes over the prompt where it drafts; --spec off runs no block
    assert fixed["prefill_mtp_seconds"] > 0 and plain["prefill_mtp_seconds"] == 0
    assert "copy stall" in fixed["timing_line"]
    assert "| 40 | off | fixed, draft oracle 1 |" in done.stdout and "| 40 | off | off |" in done.stdout
    assert "(100%)" in done.stdout


def test_table_medians_ranges_and_rival_ratios():
    run = {"prompt_tokens": 2048, "loan": "on", "prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 10.0,
           "chunk_tokens": 5376, "ring_slots": 128, "streamed_bytes": 2 * 2**30, "num_chunks": 1,
           "cache_hit_rate": 0.25, "prefill_seconds": 2.048, "active_params": 3e9, "attention_width": 4096 * 48,
           "prefill_streamed_bytes": 2**30, "generated_tokens": 128, "decode_seconds": 0.04}
    runs = [run, {**run, "prefill_tokens_per_s": 1200.0}, {**run, "prefill_tokens_per_s": 1100.0}]
    table = format_table(runs)
    assert "1,100.0 (1,000.0–1,200.0)" in table and "5,376 / 128" in table and "2,048 |" in table
    assert "| 0.25× of 4,394 |" in table  # 1,100 against the rival's 4,394 at 2k
    flops = 2 * 3e9 * 2048 + 2 * 2048**2 * 4096 * 48
    assert prefill_floor_seconds(run) == max(2**30 / 55e9, flops / 730e12)
    # decode streamed the other GiB in 127 steps (the first token is prefill's): 8 MiB a step,
    # 2**30 / 55e9 = 19.5 ms of PCIe in 40 ms of decode
    assert decode_floor_seconds(run) == 2**30 / 55e9
    # a run recorded without the VRAM read sizes reads 0 MiB from VRAM: its floor is PCIe alone
    assert "| 8 | 0 | 0.49 |" in table
    one_token = {**run, "generated_tokens": 1, "decode_tokens_per_s": 0.0, "streamed_bytes": 2**30}
    del one_token["decode_seconds"]
    assert "| 0 | 0 | 0.00 |" in format_table([one_token])  # no decode step: no division by zero
    assert "Tensor-core kernels off" not in table
    slow = {**run, "tensor_cores_off": "cffi is not installed"}
    assert "Tensor-core kernels off in this table's runs (cffi is not installed)" in format_table([run, slow])


def test_table_ratios_to_both_rivals_at_every_length():
    run = {"loan": "on", "prefill_tokens_per_s": 6000.0, "decode_tokens_per_s": 63.2, "chunk_tokens": 5376,
           "ring_slots": 128, "streamed_bytes": 2**30, "prefill_streamed_bytes": 2**30, "num_chunks": 1,
           "cache_hit_rate": 0.5, "prefill_seconds": 1.0, "active_params": 3e9, "attention_width": 4096 * 48,
           "generated_tokens": 128, "decode_seconds": 2.0, "decode_wait_seconds": 1.0}
    rows = format_table([{**run, "prompt_tokens": n} for n in (2048, 8192, 32768)]).splitlines()
    two_k, eight_k, thirty_two_k = rows[2:5]
    assert rows[-1] == "Rival: llama.cpp on the reference H200, 2026-12-01 (not this run)."
    assert "PP vs rival, experts in RAM | PP vs rival, all in VRAM" in rows[0]
    assert "TG vs rival, experts in RAM | TG vs rival, all in VRAM |" in rows[0]
    # prefill: 6,000 against 4,394 and 12,042 at 2k, 4,739 and 8,685 at 32k; no rival figure at 8k
    assert "| 1.37× of 4,394 | 0.50× of 12,042 |" in two_k
    assert "| 1.27× of 4,739 | 0.69× of 8,685 |" in thirty_two_k
    rival_cells = eight_k.rsplit("|", 4)[0]  # without the speculation columns (this run did not speculate)
    assert "| rival has no 8k figure | rival has no 8k figure |" in eight_k and "| - |" not in rival_cells
    # decode at every length: 63.2 against 32.4 in host RAM and 316 all in VRAM
    for row in (two_k, eight_k, thirty_two_k):
        assert row.endswith("| 1.95× of 32.4 | 0.20× of 316 | - | - | - |")  # no speculation: its columns empty


def test_decode_floor_reads_vram_when_nothing_streams():
    # fully resident: nothing streamed, so the PCIe term is 0 and the HBM term is the floor
    run = {"prompt_tokens": 2048, "loan": "off", "prefill_tokens_per_s": 8000.0, "decode_tokens_per_s": 240.0,
           "chunk_tokens": 2048, "ring_slots": 128, "streamed_bytes": 0, "prefill_streamed_bytes": 0,
           "num_chunks": 1, "cache_hit_rate": 1.0, "prefill_seconds": 0.256, "active_params": 3e9,
           "attention_width": 4096 * 48, "generated_tokens": 5, "decode_seconds": 0.02,
           "dense_read_bytes": 500 * 2**20, "head_read_bytes": 167 * 2**20, "expert_read_bytes": 973 * 2**20,
           "kv_bytes_per_cell": 27648.0}
    # 4 decode steps attend to 2,049..2,052 cells: 4 * 2,048 + 10 = 8,202 cells of KV in all
    expected = 4 * 1640 * 2**20 + 8202 * 27648.0
    assert decode_vram_bytes(run) == expected
    assert decode_floor_seconds(run) == expected / 3.9e12 > 0
    row = format_table([run]).splitlines()[2]
    per_step = expected / 4 / 2**20
    assert f"| 0 | {per_step:,.0f} | {expected / 3.9e12 / 0.02:.2f} |" in row
    # where the misses take longer over PCIe than the reads from VRAM, PCIe is the floor
    streaming = {**run, "streamed_bytes": 2**30}
    assert decode_floor_seconds(streaming) == 2**30 / 55e9 > expected / 3.9e12


# llama-bench's table as peer-llamacpp bench printed it on the H200 (2026-12-02): its tg row with the experts in RAM
# has fewer cells (n_batch and n_ubatch merged), the all-in-VRAM rows no exps=CPU
LLAMA_BENCH = """# llama.cpp 0c1e57098 on NVIDIA H200, 2026-12-02
| model | size | params | backend | ngl | n_batch | n_ubatch | fa | ot | lm | test | t/s |
| --- | ---: | ---: | --- | --: | ---: | ---: | --: | --- | ---: | ---: | ---: |
| qwen3moe 30B Q4_0 | 16 GiB | 30 B | CUDA | 99 | 4096 | 4096 | 1 | exps=CPU | none | pp2048 | 4415.47 ± 12.37 |
| qwen3moe 30B Q4_0 | 16 GiB | 30 B | CUDA | 99 | 4096 | 4096 | 1 | exps=CPU | none | pp32768 | 4640.38 ± 35.91 |
| qwen3moe 30B Q4_0 | 16 GiB | 30 B | CUDA | 99 | 1 | exps=CPU | none | tg128 | 37.51 ± 2.72 |
| qwen3moe 30B Q4_0 | 16 GiB | 30 B | CUDA | 99 | 4096 | 2048 | 1 | none | pp2048 | 12003.26 ± 971.17 |
| qwen3moe 30B Q4_0 | 16 GiB | 30 B | CUDA | 99 | 4096 | 2048 | 1 | none | tg128 | 318.78 ± 3.88 |
| qwen3moe 30B Q4_0 | 16 GiB | 30 B | CUDA | 99 | 4096 | 4096 | 1 | none | pp32768 | 8767.44 ± 1.75 |
"""


def test_the_rival_comes_from_llama_benchs_table_of_the_same_run(tmp_path):
    from strata.bench.rival import parse_llama_bench, read_rival
    from strata.errors import ExperimentError

    rival = parse_llama_bench(LLAMA_BENCH, "peer.txt")
    assert (rival.prefill, rival.decode) == ({2048: 4415.47, 32768: 4640.38}, 37.51)
    assert (rival.vram_prefill, rival.vram_decode) == ({2048: 12003.26, 32768: 8767.44}, 318.78)
    run = {"loan": "on", "prefill_tokens_per_s": 8830.94, "decode_tokens_per_s": 75.02, "chunk_tokens": 2048,
           "ring_slots": 128, "streamed_bytes": 2**30, "prefill_streamed_bytes": 2**30, "num_chunks": 1,
           "cache_hit_rate": 0.5, "prefill_seconds": 1.0, "active_params": 3e9, "attention_width": 4096 * 48,
           "generated_tokens": 128, "decode_seconds": 2.0, "prompt_tokens": 2048}
    table = format_table([run], rival).splitlines()
    assert "| 2.00× of 4,415 | 0.74× of 12,003 | 2.00× of 37.5 | 0.24× of 319 |" in table[2]
    assert table[-1] == "Rival: peer.txt."
    # another way to keep experts on the CPU (--n-cpu-moe), a batch sweep (the best row), VRAM rows only
    other = parse_llama_bench("""| model | n_cpu_moe | n_ubatch | test | t/s |
| --- | ---: | ---: | ---: | ---: |
| m | 48 | 512 | pp2048 | 3000.00 ± 1.00 |
| m | 48 | 4096 | pp2048 | 4000.00 ± 1.00 |
| m | 0 | 4096 | pp2048 | 9000.00 ± 1.00 |
""", "sweep.txt")
    assert (other.prefill, other.vram_prefill, other.decode) == ({2048: 4000.0}, {2048: 9000.0}, None)
    assert "rival has no figure" in format_table([run], other).splitlines()[2]
    assert parse_llama_bench(LLAMA_BENCH.replace("exps=CPU", ".ffn_.*_exps.=CPU"), "regex").prefill[2048] == 4415.47
    (tmp_path / "peer.txt").write_text("llama-bench: error: unknown model\n")
    with pytest.raises(ExperimentError, match="no llama-bench pp/tg rows"):
        read_rival(tmp_path / "peer.txt")
    with pytest.raises(ExperimentError, match="cannot read it"):
        read_rival(tmp_path / "missing.txt")


def test_table_shows_the_hosts_busy_time_a_step_and_its_widest_spread():
    run = {"prompt_tokens": 2048, "loan": "off", "prefill_tokens_per_s": 8000.0, "decode_tokens_per_s": 50.0,
           "chunk_tokens": 2048, "ring_slots": 128, "streamed_bytes": 2**30, "prefill_streamed_bytes": 2**30,
           "num_chunks": 1, "cache_hit_rate": 0.8, "prefill_seconds": 0.256, "active_params": 3e9,
           "attention_width": 4096 * 48, "generated_tokens": 65, "decode_seconds": 1.28}
    # 64 steps in 1.28 s: 20 ms a step, of which the host waited 0.64 s (10 ms a step) and worked 10 ms
    runs = [{**run, "decode_wait_seconds": wait} for wait in (0.64, 0.576, 0.704)]  # busy 10, 11, 9 ms
    assert host_busy_ms(runs[0]) == pytest.approx(10.0)
    assert "| 10.0 (9.0–11.0, ±10%) |" in format_table(runs)
    # uncaptured decode records no waits: no busy figure
    assert host_busy_ms(run) is None and "| 0.49 | - |" not in format_table([run])
    assert "| - |" in format_table([run]).splitlines()[2]


def test_a_runs_stderr_is_kept_in_its_figures_up_to_a_limit():
    text = "\n".join(["warm-up left the ledger at {...}", "", "  "] + [f"line {i}" for i in range(30)]) + "\n"
    lines = stderr_lines(text, limit=5)
    assert lines == ["warm-up left the ledger at {...}", "line 0", "line 1", "line 2", "line 3",
                     "... and 26 more line(s)"]
    assert stderr_lines("") == []


def _bench_arms(tmp_path, *options):
    """``strata bench`` of one 40-token prompt, loan off, with these arm options: (the process, its runs, model)."""
    model = write_small_moe(tmp_path / "small-moe-mtp.gguf", with_mtp=True)
    out = tmp_path / "runs.json"
    done = subprocess.run([sys.executable, "-m", "strata.cli", "--config", str(_config(tmp_path, model)), "bench",
                           "--prompt-tokens", "40", "--gen-tokens", "3", "--reps", "1", "--arms", "off", *options,
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text()), model


def test_bench_decode_miss_arms_set_the_key_per_run_and_label_their_rows(tmp_path):
    done, runs, _ = _bench_arms(tmp_path, "--decode-misses", "stage,host")
    assert [(r["decode_misses_arm"], r["decode_misses"]) for r in runs] == [("stage", "stage"), ("host", "host")]
    assert "| 40 | off | config, misses stage |" in done.stdout and "| 40 | off | config, misses host |" in done.stdout


def test_bench_deterministic_arms_set_the_key_per_run_and_label_their_rows(tmp_path):
    done, runs, model = _bench_arms(tmp_path, "--deterministic", "off,on")
    assert [(r["deterministic_arm"], r["deterministic"]) for r in runs] == [("off", False), ("on", True)]
    assert "| 40 | off | config, float sums |" in done.stdout
    assert "| 40 | off | config, fixed-point sums |" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "strata.cli", "--config", str(_config(tmp_path, model)), "bench",
                          "--prompt-tokens", "40", "--reps", "1", "--deterministic", "on,maybe"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--deterministic maybe: each arm must be one of config, off, on" in bad.stderr


def test_an_unknown_decode_miss_arm_stops_the_bench_before_any_run(tmp_path):
    model = write_small_moe(tmp_path / "small-moe-mtp.gguf", with_mtp=True)
    done = subprocess.run([sys.executable, "-m", "strata.cli", "--config", str(_config(tmp_path, model)), "bench",
                           "--prompt-tokens", "40", "--reps", "1", "--decode-misses", "stage,pinned"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--decode-misses pinned: each arm must be one of config, stage, host" in done.stderr
    assert "[off 40 #1]" not in done.stderr


def test_a_decode_miss_arm_sets_prefetching_as_its_default_has_it(tmp_path):
    from strata.bench.one_run import bench_config

    path = _config(tmp_path, write_small_moe(tmp_path / "small-moe.gguf", with_mtp=True))
    staged = bench_config(str(path), False)
    assert staged.runtime.decode_misses == "stage" and staged.runtime.decode_prefetch
    in_place = bench_config(str(path), False, "host")
    assert in_place.runtime.decode_misses == "host" and not in_place.runtime.decode_prefetch
    assert not in_place.loan.enabled and bench_config(str(path), True, "host").loan.enabled
    path.write_text(path.read_text().replace("[runtime]\n", '[runtime]\ndecode_misses = "host"\n'))
    back = bench_config(str(path), False, "stage")
    assert back.runtime.decode_misses == "stage" and back.runtime.decode_prefetch


def test_without_a_rival_table_only_the_earlier_runs_model_divides_by_its_figures(tmp_path):
    # the built-in figures are llama.cpp's on the synthetic Qwen3-30B-A3B Q4_0: a Q4_K_M file of the same shape
    # gets no ratios and a source line that says to pass --rival (header-only files: a 30B shape in a second)
    from gguf import GGMLQuantizationType

    from strata.bench.rival import EARLIER_RUN, EARLIER_RUN_MODEL, model_identity, read_rival
    from strata.model.synth import PRESETS, write_synthetic_model

    shape = PRESETS["qwen3-30b-a3b"]
    q4_0 = write_synthetic_model(tmp_path / "q4_0.gguf", shape, GGMLQuantizationType.Q4_0, seed=0, with_mtp=True,
                                 is_header_only=True)
    q4_k_m = write_synthetic_model(tmp_path / "q4_k_m.gguf", shape, "Q4_K_M", seed=0, is_header_only=True)
    assert model_identity(q4_0) == EARLIER_RUN_MODEL
    assert read_rival(None, q4_0) is EARLIER_RUN
    other = read_rival(None, q4_k_m)
    assert (other.prefill, other.decode, other.vram_prefill, other.vram_decode) == ({}, None, {}, None)
    assert "MOSTLY_Q4_K_M" in other.source and "pass --rival" in other.source
    assert "pass --rival" in read_rival(None, tmp_path / "missing.gguf").source
    run = {"loan": "on", "prefill_tokens_per_s": 8830.94, "decode_tokens_per_s": 75.02, "chunk_tokens": 2048,
           "ring_slots": 128, "streamed_bytes": 2**30, "prefill_streamed_bytes": 2**30, "num_chunks": 1,
           "cache_hit_rate": 0.5, "prefill_seconds": 1.0, "active_params": 3e9, "attention_width": 4096 * 48,
           "generated_tokens": 128, "decode_seconds": 2.0, "prompt_tokens": 2048}
    assert "×" not in format_table([run], other).splitlines()[2]


def test_spec_arms_take_a_fixed_depth_up_to_the_configured_one():
    from types import SimpleNamespace

    from strata.bench.one_run import set_speculation, spec_mode

    assert [spec_mode(m) for m in ("config", "auto", "fixed", "off", "fixed-2")] == \
        ["config", "auto", "fixed", "off", "fixed-2"]
    for bad in ("fixed-0", "fixed-", "fixed-x", "fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="fixed-N"):
            spec_mode(bad)
    engine = SimpleNamespace(mtp=object(), depth_policy=None,
                             config=SimpleNamespace(runtime=SimpleNamespace(spec_depth=4)))
    set_speculation(engine, "fixed-2")
    assert engine.depth_policy.max_depth == 2 and engine.depth_policy.is_fixed
    assert engine.depth_policy.depth(10) == 2
    set_speculation(engine, "auto")
    assert engine.depth_policy.max_depth == 4 and not engine.depth_policy.is_fixed
    with pytest.raises(SystemExit, match="at most runtime.spec_depth = 4"):
        set_speculation(engine, "fixed-5")


def test_a_runs_output_is_compared_with_the_plain_runs_to_the_first_difference():
    from strata.bench.one_run import _first_difference

    assert _first_difference([1, 2, 3], [1, 2, 3]) is None
    assert _first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert _first_difference([1, 2], [1, 2, 3]) == 2  # ended early

"""`strata check` and `strata pack` through the command line, and the pack's tie to its GGUF."""

import dataclasses
import json
import re
import textwrap
import tomllib
from pathlib import Path

import numpy as np
import pytest
from engine_setup import SMALL_MOE, greedy
from gguf import GGMLQuantizationType as QType

from strata.backend.dry_run import DryRunOps
from strata.cli import main
from strata.cli.check import cached_after_load
from strata.config import load_config
from strata.engine.facade import Engine
from strata.engine.memory.expert_pack import HEADER_BYTES
from strata.engine.planning.planner import CacheState
from strata.errors import ModelFormatError, StaleExpertPackError
from strata.model.synth import PRESETS, with_overrides, write_synthetic_model

REPO = Path(__file__).resolve().parents[2]
ALL_PLUGINS = ["loan_mtp", "loan_head", "retain_startup_chunk", "repeat_loan"]
# a top-level row of a placement table: label, bytes, MiB, share, note (parts of the workspace are indented)
ROW = re.compile(r"^  (\S[^\s]*)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)%(.*)$")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two GGUFs of the same shape, written with different seeds."""
    folder = tmp_path_factory.mktemp("models")
    return [write_synthetic_model(folder / f"small-moe-mtp-{seed}.gguf", SMALL_MOE, QType.Q4_0, seed=seed,
                                  with_mtp=True) for seed in (7, 8)]


def write_config(path: Path, model: Path, expert_pack: Path | None = None, is_loan: bool = True,
                 max_chunk_tokens: int = 64, **runtime) -> Path:
    runtime = {"backend": "numpy", "context_tokens": 1024, "vram_budget": "160MiB", "vram_elastic": True,
               "vmm_segment": "64MiB", "serve": True, "mtp": True, "spec_depth": 2, **runtime}
    runtime_lines = "\n        ".join(f"{key} = {json.dumps(value)}" for key, value in runtime.items())
    pack_line = f"expert_pack = {json.dumps(str(expert_pack))}" if expert_pack else ""
    loan_table = f"[loan]\n        enabled = true\n        plugins = {json.dumps(ALL_PLUGINS)}" if is_loan else ""
    path.write_text(textwrap.dedent(f"""
        [model]
        path = {json.dumps(str(model))}
        {pack_line}
        [runtime]
        {runtime_lines}
        [planner]
        chunk_quantum_tokens = 16
        max_ring_slots = 16
        max_chunk_tokens = {max_chunk_tokens}
        {loan_table}
    """))
    return path


def placement_tables(out: str) -> list[dict[str, tuple[int, str]]]:
    """Each placement table's top-level rows: label → (bytes, the rest of the line)."""
    tables, table = [], None
    for line in out.splitlines():
        if "placement" in line and line.endswith(":"):
            table = {}
            tables.append(table)
            continue
        match = ROW.match(line) if table is not None else None
        if match:
            label, num_bytes, mib, share, note = match.groups()
            table[label] = (int(num_bytes.replace(",", "")), float(mib), float(share), note)
        elif table is not None and not line.startswith("    ") and not line.startswith("  owner"):
            table = None
    return tables


def run_check(config: Path, capsys) -> str:
    assert main(["--config", str(config), "check"]) == 0
    return capsys.readouterr().out


def test_check_prints_every_owner_in_bytes_and_share_and_both_plans_with_their_reasons(models, tmp_path, capsys):
    config = write_config(tmp_path / "check.toml", models[0])
    out = run_check(config, capsys)
    engine = Engine.load(load_config(config), show_progress=False, is_dry_run=True)
    budget_bytes = engine.ledger.budget_bytes
    startup, idle = placement_tables(out)
    for table, owners in ((startup, engine.ledger.snapshot().by_owner), (idle, engine.idle_ledger.by_owner)):
        assert set(owners) | {"prefill_workspace", "free", "budget"} <= set(table)
        for label, (num_bytes, mib, share, _) in table.items():
            assert mib == pytest.approx(num_bytes / 2**20, abs=0.051)
            assert share == pytest.approx(100 * num_bytes / budget_bytes, abs=0.0051)
        for owner, num_bytes in owners.items():
            lent = table["expert_cache"][3] if owner == "expert_cache" else ""
            lent_bytes = int(re.search(r"\(([\d,]+) bytes lent", lent).group(1).replace(",", "")) if lent else 0
            assert table[owner][0] + lent_bytes == num_bytes
        assert table["budget"][0] == budget_bytes
        assert sum(v[0] for k, v in table.items() if k != "budget") == budget_bytes
        assert table["free"][0] >= 0 and table["prefill_workspace"][0] > 0
    for name in ("verifier", "output_head", "mtp_draft_head", "mtp_experts"):  # the startup loan defers them
        assert startup[name][0] == 0 and "deferred" in startup[name][3] and idle[name][0] > 0
    longest = engine.context_tokens - 1
    cache = CacheState(engine.cache.num_slots, cached_after_load(engine, engine.config))
    without = engine.loan.plan_preview(is_loan=False, unread_tokens=longest, cache=cache)
    assert f"plan without the loan for the longest prompt, {longest:,} tokens (chunk / ring): {without}" in out
    assert f"plan with the loan (chunk / ring): {engine.loan.startup_geometry}" in out
    reasons = [line for line in out.splitlines() if line.startswith("  planner: ")]
    assert len(reasons) == 2 and all(("chunk bound by" in r or "chosen by the cost model" in r)
                                     and "ring bound by" in r for r in reasons)
    assert out.count("  cost model: ") == 2 and "chunks weighed" in out and "; chose " in out
    assert "rates: PCIe host→device 55.0 GB/s, assumed: numpy backend, no GPU to probe" in out
    assert "context: 1,024 tokens (runtime.context_tokens) in 1,024 resident KV cells" in out


def test_check_without_the_loan_prints_one_plan_and_the_idle_table(models, tmp_path, capsys):
    out = run_check(write_config(tmp_path / "off.toml", models[0], is_loan=False), capsys)
    assert "loan: off" in out and "plan with the loan" not in out
    (idle,) = placement_tables(out)
    assert {"free", "prefill_workspace", "verifier"} <= set(idle)
    assert "planner: " in out and "chunk bound by" in out


def test_configured_rates_are_used_and_labelled_and_no_probe_runs(models, tmp_path, capsys, monkeypatch):
    def no_probe(ops):
        raise AssertionError("a configured PCIe rate needs no probe")

    monkeypatch.setattr(DryRunOps, "probe_host_to_device", no_probe)
    config = write_config(tmp_path / "rates.toml", models[0])
    config.write_text(config.read_text().replace("[planner]", "[planner]\npcie_bytes_per_s = 12e9\n"
                                                               "compute_flops_per_s = 3e12"))
    out = run_check(config, capsys)
    assert ("rates: PCIe host→device 12.0 GB/s, configured by planner.pcie_bytes_per_s; compute 3.0 TFLOP/s, "
            "configured by planner.compute_flops_per_s") in out
    assert "at 12.0 GB/s" in out and "at 3.0 TFLOP/s" in out


def test_check_with_the_head_alias_lends_the_output_head_to_the_workspace_of_the_plan(tmp_path, capsys):
    # a 32k vocabulary makes the head worth ~200 chunk tokens
    model = write_synthetic_model(tmp_path / "wide-head.gguf", dataclasses.replace(SMALL_MOE, vocab_size=32768),
                                  QType.Q4_0, seed=7, with_mtp=True)
    # on the GPU's layout activations take free memory: the chunk is bound by it, the head's bytes in it
    out = run_check(write_config(tmp_path / "alias.toml", model, is_loan=False, max_chunk_tokens=16384,
                                 context_tokens=16384, prefill_head_alias=True, backend="cuda"), capsys)
    (idle,) = placement_tables(out)
    assert idle["output_head"][0] == 0 and "runtime.prefill_head_alias" in idle["output_head"][3]
    assert idle["free"][0] >= 0 and sum(v[0] for k, v in idle.items() if k != "budget") == idle["budget"][0]
    assert "set outside the planner" not in out and "chunk bound by" in out


def test_a_budget_that_leaves_the_cache_less_than_one_segment_is_refused_with_the_fix(tmp_path, capsys):
    # on the GPU a segment is 64 MiB of slots with each plane rounded up to the mapping granularity:
    # 72 MiB for this model, so 90 MiB leaves the cache its 64 MiB share and no segment
    model = write_synthetic_model(tmp_path / "wide-head.gguf", dataclasses.replace(SMALL_MOE, vocab_size=32768),
                                  QType.Q4_0, seed=7, with_mtp=True)
    config = write_config(tmp_path / "short.toml", model, is_loan=False, vram_budget="90MiB", backend="cuda")
    assert main(["--config", str(config), "check"]) == 2
    error = capsys.readouterr().err
    assert "less than one of its segments (72 MiB" in error and "raise runtime.vram_budget by at least 8 MiB" in error


def test_check_explains_plans_for_a_context_one_past_a_quantum_as_the_planner_made_them(models, tmp_path, capsys):
    out = run_check(write_config(tmp_path / "odd.toml", models[0], context_tokens=1025), capsys)
    assert "set outside the planner" not in out and "chunk bound by" in out


def test_a_file_that_is_not_an_expert_pack_is_refused_with_the_fix(models, tmp_path):
    pack = tmp_path / "noise.strpack"
    pack.write_bytes(bytes(range(256)) * 64)
    config = load_config(write_config(tmp_path / "noise.toml", models[0], expert_pack=pack))
    with pytest.raises(ModelFormatError, match=r"cannot read expert pack.*strata --config FILE pack"):
        Engine.load(config, show_progress=False)


def test_check_refuses_the_packs_a_load_would_refuse_with_the_same_fix(models, tmp_path, capsys):
    pack = tmp_path / "seed7.strpack"
    assert main(["--config", str(write_config(tmp_path / "a.toml", models[0])), "pack", "--out", str(pack)]) == 0
    capsys.readouterr()
    assert main(["--config", str(write_config(tmp_path / "own.toml", models[0], expert_pack=pack)), "check"]) == 0
    assert main(["--config", str(write_config(tmp_path / "b.toml", models[1], expert_pack=pack)), "check"]) == 2
    assert ("the GGUF changed or is another one; write it again with `strata --config FILE pack`"
            in capsys.readouterr().err)
    missing = tmp_path / "missing.strpack"
    assert main(["--config", str(write_config(tmp_path / "c.toml", models[0], expert_pack=missing)), "check"]) == 2
    assert f"{missing}: cannot read expert pack" in capsys.readouterr().err
    short = tmp_path / "short.strpack"
    short.write_bytes(pack.read_bytes()[:-1])
    assert main(["--config", str(write_config(tmp_path / "d.toml", models[0], expert_pack=short)), "check"]) == 2
    assert f"{short}: expert pack is truncated" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["numpy", "cudasim"])
def test_check_shows_both_tiers_of_kv_cells_and_serves_the_whole_context(models, tmp_path, capsys, backend):
    config = write_config(tmp_path / "tiers.toml", models[0], kv_resident_cells=512, backend=backend)
    out = run_check(config, capsys)
    engine = Engine.load(load_config(config), show_progress=False, is_dry_run=True)
    placement, cell_bytes = engine.placement, engine.placement.kv_bytes // 512
    assert engine.context_tokens == 1024 and placement.host_kv_bytes == 512 * cell_bytes
    assert "context: 1,024 tokens (runtime.context_tokens) in 512 resident KV cells (f16)" in out
    tiers = (f"  KV tiers: VRAM 512 cells ({placement.kv_bytes / 2**20:.1f} MiB, kv_cache), host 512 cells "
             f"({placement.host_kv_bytes / 2**20:.1f} MiB of pinned host memory, outside the budget)")
    assert tiers in out
    staging = placement_tables(out)[-1].get("kv_staging")
    if backend == "numpy":  # attention reads the host cells where they lie
        assert f"{tiers}, read where they lie" in out and staging is None and not placement.kv_staging_bytes
    else:  # two layers of every cell, K and V
        assert placement.kv_staging_bytes == 2 * 1024 * cell_bytes // SMALL_MOE.num_layers
        assert staging[0] == placement.kv_staging_bytes
        assert f"{tiers}, read through the {placement.kv_staging_bytes / 2**20:.1f} MiB of kv_staging layers" in out
    assert f"longest prompt, {1023:,} tokens" in out


def test_check_refuses_a_host_tier_larger_than_the_host_memory(models, tmp_path, capsys, monkeypatch):
    from strata.engine import loading

    monkeypatch.setattr(loading, "available_host_bytes", lambda: 1 << 10)
    assert main(["--config", str(write_config(tmp_path / "big.toml", models[0], kv_resident_cells=512)), "check"]) == 2
    assert "does not fit in the 0.0 MiB of host memory available" in capsys.readouterr().err
    assert main(["--config", str(write_config(tmp_path / "short.toml", models[0], kv_resident_cells=32)),
                 "check"]) == 2
    assert "runtime.kv_resident_cells = 32 is smaller than one prefill chunk" in capsys.readouterr().err


def test_pack_writes_a_file_that_the_engine_loads(models, tmp_path, capsys):
    pack = tmp_path / "small.strpack"
    config = write_config(tmp_path / "pack.toml", models[0])
    assert main(["--config", str(config), "pack", "--out", str(pack)]) == 0
    assert f"wrote {pack}" in capsys.readouterr().out
    engine = Engine.load(load_config(write_config(tmp_path / "packed.toml", models[0], expert_pack=pack)),
                         show_progress=False)
    in_memory = Engine.load(load_config(config), show_progress=False)
    assert np.array_equal(engine.pack.buffer, in_memory.pack.buffer)
    prompt = list(range(3, 60))
    assert greedy(engine, prompt, 4)[0] == greedy(in_memory, prompt, 4)[0]


def test_a_pack_of_another_gguf_of_the_same_shape_is_refused(models, tmp_path, capsys):
    pack = tmp_path / "seed7.strpack"
    assert main(["--config", str(write_config(tmp_path / "a.toml", models[0]), ), "pack", "--out", str(pack)]) == 0
    other = load_config(write_config(tmp_path / "b.toml", models[1], expert_pack=pack))
    with pytest.raises(StaleExpertPackError) as refused:
        Engine.load(other, show_progress=False)
    message = str(refused.value)
    assert str(pack) in message and models[0].name in message and models[1].name in message
    assert "strata --config FILE pack" in message


def test_a_pack_of_the_previous_format_is_refused_with_the_same_fix(models, tmp_path, capsys):
    pack = tmp_path / "old.strpack"
    assert main(["--config", str(write_config(tmp_path / "a.toml", models[0])), "pack", "--out", str(pack)]) == 0
    with open(pack, "r+b") as f:  # the version-1 header: no identity of the source
        header = json.loads(f.read(HEADER_BYTES).rstrip(b"\0"))
        header = {k: v for k, v in header.items() if not k.startswith("source_")}
        f.seek(0)
        f.write(json.dumps({**header, "magic": "strata-expert-pack-1"}).encode().ljust(HEADER_BYTES, b"\0"))
    config = load_config(write_config(tmp_path / "old.toml", models[0], expert_pack=pack))
    with pytest.raises(StaleExpertPackError, match=r"'strata-expert-pack-1'.*strata --config FILE pack"):
        Engine.load(config, show_progress=False)


def test_check_on_the_benchmark_configuration_gives_the_documented_plans(tmp_path, capsys, monkeypatch):
    # the real header and tensor table of the benchmark's model, its tensor data a hole: the dry
    # run reads only shapes and sizes; the GPU's probe a fake of 53 GB/s copies behind 15 us each
    samples = [(size, 15e-6 + size / 53e9) for size in (4 << 20, 16 << 20, 64 << 20) for _ in range(4)]
    monkeypatch.setattr(DryRunOps, "probe_host_to_device", lambda ops: samples)
    model = write_synthetic_model(tmp_path / "qwen3-30b-a3b-q4_0-mtp.gguf", PRESETS["qwen3-30b-a3b"], QType.Q4_0,
                                  seed=0, with_mtp=True, is_header_only=True)

    def with_model(name: str) -> str:  # configs/NAME with the model above and no expert pack
        text, num_paths = re.subn(r'(?m)^(path|expert_pack) = "[^"]*?(\.gguf|\.strpack)"$',
                                  lambda m: f'{m[1]} = "{model.with_suffix(m[2])}"' if m[1] == "path"
                                  else "# no expert pack: this model's hole has no experts",
                                  (REPO / "configs" / name).read_text())
        assert num_paths == 2
        return text

    text = with_model("bench-h200.toml")
    config = tmp_path / "bench-h200.toml"
    config.write_text(text)
    out = run_check(config, capsys)
    assert "backend: cuda" in out  # the dry run charges as the GPU would, and touches none
    assert "rates: PCIe host→device 53.0 GB/s, measured at load: 12 pinned copies of 4-64 MiB" in out
    assert "compute 20.0 TFLOP/s, assumed until a prefill chunk calibrates it" in out
    costs = [line for line in out.splitlines() if line.startswith("  cost model: ")]
    assert len(costs) == 2 and all("chunks weighed with a ring of 128" in c and c.endswith(")") and
                                   "chose 16,384 / 128" in c for c in costs)
    assert out.count("at 53.0 GB/s overlapped with compute") == 2  # both plans predict with the probe's rate
    assert "plan without the loan for the longest prompt, 34,815 tokens (chunk / ring): 16,384 / 128\n" in out
    assert "plan with the loan (chunk / ring): 16,384 / 128\n" in out
    reasons = [line for line in out.splitlines() if line.startswith("  planner: ")]
    assert all("ring bound by the target of one layer's experts (128)" in r for r in reasons) and len(reasons) == 2
    # both plans are the same here, and the MTP block's pass over the prompt runs under the loan too (what it
    # reads stays resident): a repeat loan saves nothing, and costs its uploads and its own work
    gains = next(line for line in out.splitlines() if line.startswith("loan's predicted gain for a repeat loan"))
    found = re.findall(r"([\d,]+) tokens ([+-][\d,]+) ms \(([\d,]+ / \d+) against ([\d,]+ / \d+)\)", gains)
    assert [n for n, *_ in found] == ["2,048", "8,192", "32,768", "34,815"] and all(on == off for *_, on, off in found)
    saved = [int(ms.replace(",", "")) for _, ms, *_ in found]
    assert all(ms < 0 for ms in saved)
    # the write-up's model in 8 GiB without MTP and without the loan: the chunk borrows the expert cache
    bare = with_model("bench-h200-no-mtp.toml")
    parsed = tomllib.loads(bare)
    assert parsed["runtime"]["mtp"] is False and "loan" not in parsed
    config.write_text(bare)
    out = run_check(config, capsys)
    chunk = re.search(r"plan without the loan for the longest prompt, 34,815 tokens \(chunk / ring\): ([\d,]+) /", out)
    assert "loan: off" in out and int(chunk[1].replace(",", "")) >= 4096


@pytest.mark.parametrize("preset", ["Q4_K_M", "IQ3_XXS"])
def test_the_mixed_format_benchmark_configurations_check_with_a_loan_and_a_long_chunk(preset, tmp_path, capsys):
    # issue 30's end-to-end configurations: llama.cpp's per-tensor mix, no MTP block (llama.cpp loads the
    # same file), the loan admitted without the plugins that need MTP, the chunk borrowing the cache
    name = f"bench-h200-{preset.lower()}.toml"
    text = (REPO / "configs" / name).read_text()
    parsed = tomllib.loads(text)
    assert parsed["runtime"]["mtp"] is False and parsed["loan"]["enabled"] is True
    assert Path(parsed["model"]["path"]).name == f"qwen3-30b-a3b-{preset.lower()}.gguf"
    assert f"--qtype {preset} {parsed['model']['path']}" in text  # the comment's synth command writes that file
    model = write_synthetic_model(tmp_path / "model.gguf", PRESETS["qwen3-30b-a3b"], preset, seed=0,
                                  is_header_only=True)
    text = re.sub(r'(?m)^path = ".*"$', f'path = "{model}"', text)
    text = re.sub(r'(?m)^expert_pack = ".*"$', "", text)
    config = tmp_path / name
    config.write_text(text)
    out = run_check(config, capsys)
    assert "loan: admitted with plugins retain_startup_chunk, repeat_loan" in out
    for plan in ("plan without the loan for the longest prompt, 34,815 tokens (chunk / ring): ",
                 "plan with the loan (chunk / ring): "):
        chunk = re.search(re.escape(plan) + r"([\d,]+) /", out)
        assert chunk and int(chunk[1].replace(",", "")) >= 4096, out


def test_a_mixtral_shaped_model_plans_long_chunks_with_a_ring_of_what_fits(tmp_path, capsys):
    # Mixtral 8x7B's shape as a llama MoE (experts 14,336 wide: a slot of ~109 MiB in Q4_K_M, whose Q6_K ffn_down
    # layers set it) in 8 GiB without MTP or the loan: a ring of at most a layer's 8 experts, the chunk borrowing
    # the cache
    model = write_synthetic_model(tmp_path / "mixtral.gguf", PRESETS["mixtral-8x7b"], "Q4_K_M", seed=0,
                                  is_header_only=True)
    text = re.sub(r'(?m)^path = ".*"$', f'path = "{model}"', (REPO / "configs" / "bench-h200-no-mtp.toml").read_text())
    text = re.sub(r'(?m)^expert_pack = ".*"$', "", text)
    config = tmp_path / "mixtral.toml"
    config.write_text(text)
    out = run_check(config, capsys)
    assert "model: mixtral.gguf (llama, 32 layers, 8 experts of which 2 per token)" in out
    plan = re.search(r"plan without the loan for the longest prompt, 34,815 tokens \(chunk / ring\): ([\d,]+) / (\d+)",
                     out)
    assert plan and int(plan[1].replace(",", "")) >= 4096 and 1 <= int(plan[2]) <= 8, out
    slot_mib = float(re.search(r"ring \d+ × ([\d.]+) MiB", out)[1])
    assert 100 < slot_mib < 120


def test_a_dense_model_past_the_budget_is_refused_naming_its_weights(tmp_path, capsys):
    # a Qwen3-32B-shaped dense file: no experts stream, so its 18 GiB of weights must fit the budget
    shape = with_overrides(PRESETS["tiny-qwen3"], num_layers=64, hidden_size=5120, num_heads=64, num_kv_heads=8,
                           head_dim=128, dense_ffn_size=25600, vocab_size=151936, context_length=40960)
    model = write_synthetic_model(tmp_path / "qwen3-32b.gguf", shape, "Q4_K_M", seed=0, is_header_only=True)
    text = re.sub(r'(?m)^path = ".*"$', f'path = "{model}"', (REPO / "configs" / "bench-h200-no-mtp.toml").read_text())
    config = tmp_path / "dense.toml"
    config.write_text(re.sub(r'(?m)^expert_pack = ".*"$', "", text))
    assert main(["--config", str(config), "check"]) == 2
    error = capsys.readouterr().err
    assert "runtime.vram_budget = 8.00 GiB cannot hold this model: dense weights 18232 MiB" in error
    assert "cache segment" not in error and "raise runtime.vram_budget" in error

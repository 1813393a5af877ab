"""`strata experiment NAME` end to end on a small numpy MoE: every driver's arms in fresh processes
(a serving process for lifecycle), its JSON, table and plot; render from the JSON; bad input."""

import importlib.util
import json
import sys
import tomllib

import pytest
from engine_setup import LOAN_RUNTIME, write_small_moe

from strata.bench.experiments import arm_config
from strata.bench.experiments.results import PLOT_EXTRA
from strata.cli import main

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PLUGINS = ["loan_head", "loan_mtp", "repeat_loan", "retain_startup_chunk"]
INSTALLED = sorted([*PLUGINS, "cost_gate"])  # every built-in the process finds
TINY = ["--gen-tokens", "2", "--reps", "1"]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("experiment")
    write_small_moe(folder / "small-moe-mtp.gguf", with_mtp=True)
    runtime = {**LOAN_RUNTIME, "backend": "numpy"}
    lines = ["# strata synth --preset tiny --mtp small-moe-mtp.gguf", "[model]", 'path = "small-moe-mtp.gguf"',
             "[runtime]", *(f"{k} = {json.dumps(v)}" for k, v in runtime.items()),
             "[planner]", "chunk_quantum_tokens = 16", "max_chunk_tokens = 32", "max_ring_slots = 16",
             "[loan]", "enabled = true", f"plugins = {json.dumps(PLUGINS)}",
             "[loan.repeat_loan]", "min_tokens = 1024"]
    path = folder / "experiment.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_experiment(name, config, out, *options):
    assert main(["experiment", name, "--config", str(config), "--out", str(out), *options]) == 0
    doc = json.loads((out / f"{name}.json").read_text())
    table = (out / f"{name}.md").read_text()
    assert doc["experiment"] == name and doc["code"].startswith("strata ") and doc["summary"]["verdict"] in table
    assert doc["device"] == "numpy backend, no GPU" and doc["device"] in table.splitlines()[0]
    if HAS_MATPLOTLIB:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return doc, table


def test_default_off_runs_one_arm_with_the_plugins_uninstalled_and_one_without_a_loan_table(config, tmp_path):
    doc, table = run_experiment("default-off", config, tmp_path, "--prompt-tokens", "40", *TINY)
    assert [arm["name"] for arm in doc["arms"]] == ["uninstalled", "installed"]
    uninstalled, installed = doc["runs"]
    assert (uninstalled["arm"], uninstalled["plugins"]) == ("uninstalled", [])
    assert (installed["arm"], installed["plugins"]) == ("installed", INSTALLED)
    arm_file = tomllib.loads((tmp_path / "configs" / "no-loan-table.toml").read_text())
    assert "loan" not in arm_file and arm_file["model"]["path"] == str(config.parent / "small-moe-mtp.gguf")
    # the summary goes on with the transaction's phase times where one took half a millisecond
    assert all(run["loan_summary"].startswith("loan off (loan.enabled is false)") for run in doc["runs"])
    summary = doc["summary"]
    assert summary["is_uninstalled"] and summary["is_same_plan"]
    assert summary["passed"] == (abs(summary["pp_change"]) <= 0.01 and abs(summary["tg_change"]) <= 0.01)
    assert table.splitlines()[2] == ("| Configuration | Loan plugins found | Prompt chunk / ring | PP median (range) "
                                     "| TG median (range) |")
    assert f"| Loan plugins uninstalled | none | 32 / 16 | {uninstalled['prefill_tokens_per_s']:,.1f} (" in table
    assert f"| {', '.join(INSTALLED)} | 32 / 16 |" in table


@pytest.fixture(scope="module")
def loans_folder(config, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loans")
    run_experiment("loans", config, folder, "--prompt-tokens", "40", *TINY)
    return folder


def test_loans_runs_the_flags_off_and_on_and_the_on_arm_takes_the_loan(loans_folder):
    doc, table = json.loads((loans_folder / "loans.json").read_text()), (loans_folder / "loans.md").read_text()
    off, on = doc["runs"]
    assert (off["arm"], on["arm"]) == ("off", "on") and (off["prompt_tokens"], on["generated_tokens"]) == (40, 2)
    assert off["loan_summary"].startswith("loan off") and on["loan_summary"].startswith("loan on (startup loan")
    assert doc["summary"]["loans_taken"] == 1 and doc["summary"]["passed"]
    assert "| Loan flags off | 32 / 16 |" in table and "| Loan flags on | 32 / 16 |" in table


def test_fixed_geometry_forces_both_arms_to_one_plan(config, tmp_path):
    doc, table = run_experiment("fixed-geometry", config, tmp_path, "--prompt-tokens", "40", "--chunk-tokens", "16",
                                "--ring-slots", "8", *TINY)
    assert [(r["arm"], r["chunk_tokens"], r["ring_slots"], r["num_chunks"]) for r in doc["runs"]] == [
        ("off", 16, 8, 3), ("on", 16, 8, 3)]  # the free plan is 32 / 16 in 2 chunks
    assert doc["summary"]["is_forced"] and doc["summary"]["forced_plan"] == "16 / 8"
    assert "| Loan flags on, same plan | 16 / 8 |" in table and "Both arms forced to 16 / 8 (options)" in table


def test_host_tier_gives_the_tokens_of_every_cell_resident(config, tmp_path):
    tiered = tmp_path / "tiered.toml"
    tiered.write_text(config.read_text().replace("[runtime]", "[runtime]\ncontext_tokens = 256\nkv_resident_cells = 32")
                      .replace('path = "small-moe-mtp.gguf"', f'path = "{config.parent / "small-moe-mtp.gguf"}"'))
    out = tmp_path / "results"
    doc, table = run_experiment("host-tier", tiered, out, "--prompt-tokens", "40", "--gen-tokens", "4", "--reps", "2")
    assert [(r["arm"], r["rep"]) for r in doc["runs"]] == [("tier", 1), ("resident", 1), ("tier", 2), ("resident", 2)]
    tier, resident = doc["runs"][:2]
    assert tier["output_ids"] == resident["output_ids"] and len(tier["output_ids"]) == 4
    assert doc["runs"][2]["output_ids"] != tier["output_ids"]  # another repetition, another seeded prompt
    assert tier["kv_host_bytes"] > 0 and resident["kv_host_bytes"] == 0
    arm_files = {name: tomllib.loads((out / "configs" / f"{name}.toml").read_text())["runtime"]
                 for name in ("host-tier", "all-resident")}
    assert arm_files["host-tier"]["deterministic"] and arm_files["all-resident"]["deterministic"]
    assert (arm_files["host-tier"]["kv_resident_cells"], arm_files["all-resident"]["kv_resident_cells"]) == (32, 256)
    summary = doc["summary"]
    assert summary["passed"] and (summary["num_prompts"], summary["num_equal"]) == (2, 2)
    assert "The same greedy tokens in 2 of 2 prompt(s)" in table and "| KV host tier moved |" in table


def test_host_tier_refuses_a_configuration_without_one(config, tmp_path, capsys):
    assert main(["experiment", "host-tier", "--config", str(config), "--out", str(tmp_path), "--prompt-tokens", "40",
                 *TINY]) == 2
    assert "nothing lives in the host tier; set kv_resident_cells below the context" in capsys.readouterr().err


def test_crossover_runs_off_on_and_the_engines_choice_at_each_length(config, tmp_path):
    doc, table = run_experiment("crossover", config, tmp_path, "--prompt-tokens", "24,40", *TINY)
    assert [(r["prompt_tokens"], r["arm"]) for r in doc["runs"]] == [
        (24, "off"), (24, "on"), (24, "auto"), (40, "off"), (40, "on"), (40, "auto")]
    auto = tomllib.loads((tmp_path / "configs" / "crossover-auto.toml").read_text())["loan"]
    assert auto["plugins"] == ["loan_head", "loan_mtp", "retain_startup_chunk", "cost_gate"]  # no repeat_loan
    assert "repeat_loan" not in auto  # its table goes with it: a table for a plugin not loaded is refused
    assert all("cost model" in r["loan_summary"] for r in doc["runs"] if r["arm"] == "auto")
    summary = doc["summary"]
    assert sorted(summary["lengths_paying"] + summary["lengths_not_paying"]) == [24, 40]
    assert "The engine's own choice took the loan in 24: " in summary["verdict"]
    assert table.count("| 24 | ") == 3 and table.count("| 40 | ") == 3 and "| 24 | Engine's choice |" in table
    assert "| Prompt | Loan | Prompt chunk / ring | PP median (range) | TG median (range) | PP with the loan |" in table


def test_lifecycle_serves_every_request_from_one_process_and_compares_with_a_fresh_one(config, tmp_path):
    doc, table = run_experiment("lifecycle", config, tmp_path, "--prompt-tokens", "300", "--warmup-tokens", "20",
                                "--after-requests", "2", "--after-tokens", "40", "--repeat-min-tokens", "256", *TINY)
    requests = doc["requests"]
    assert [r["request"] for r in requests] == ["warm-up", "long", "after 1", "after 2"]
    assert all(r["status"] == 200 and r["generated_tokens"] == r["gen_tokens"] for r in requests)
    assert [r["strata"]["loan"]["is_taken"] for r in requests] == [True, True, False, False]  # startup, repeat
    assert all(r["ledger_idle_after"] for r in requests)
    assert [(r["arm"], r["prompt_tokens"]) for r in doc["runs"]] == [("fresh", 300)]
    summary = doc["summary"]
    assert summary["is_long_loan"] and summary["is_ledger_idle"] and not summary["failed_requests"]
    expected = requests[1]["decode_tokens_per_s"] / doc["runs"][0]["decode_tokens_per_s"] - 1
    assert summary["decode_change"] == pytest.approx(expected)
    assert "min_tokens = 256" in (tmp_path / "configs" / "serve.toml").read_text()
    assert "GET /metrics" in (tmp_path / "lifecycle-server.log").read_text()
    assert "| long | 300 | 2 | on |" in table and "| fresh process (median of 1) | 300 | 2 | on |" in table


def test_render_draws_the_table_and_plot_again_and_names_the_plot_extra_without_matplotlib(loans_folder, tmp_path,
                                                                                          monkeypatch, capsys):
    table, json_path = loans_folder / "loans.md", loans_folder / "loans.json"
    expected = table.read_text()
    assert main(["experiment", "render", str(json_path), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "loans.md").read_text() == expected
    if HAS_MATPLOTLIB:
        assert (tmp_path / "loans.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table.unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    capsys.readouterr()
    assert main(["experiment", "render", str(json_path)]) == 2
    assert PLOT_EXTRA in capsys.readouterr().err and table.read_text() == expected


def test_a_missing_model_names_the_synth_command_and_bad_options_name_the_fix(config, tmp_path, capsys):
    missing = tmp_path / "missing.toml"
    missing.write_text(config.read_text().replace("small-moe-mtp.gguf", "absent.gguf"))
    assert main(["experiment", "loans", "--config", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert f"strata synth --preset tiny --mtp {tmp_path / 'absent.gguf'}" in capsys.readouterr().err
    options = [("lifecycle", "--prompt-tokens", "300", "--gen-tokens", "2"),  # repeat_loan's default 1,024 > 300
               ("loans", "--prompt-tokens", "40,80"), ("loans", "--prompt-tokens", "4096")]
    messages = ["pass --repeat-min-tokens 300 or less", "loans runs one prompt length",
                "exceed runtime.context_tokens = 4,096"]
    for (name, *args), message in zip(options, messages):
        assert main(["experiment", name, "--config", str(config), "--out", str(tmp_path / "out"), *args]) == 2
        assert message in capsys.readouterr().err


def test_arm_files_resolve_relative_paths_and_set_nested_tables(tmp_path):
    raw = {"model": {"path": "m.gguf", "expert_pack": "/abs/m.strpack"}, "runtime": {"lock_dir": "locks"},
           "loan": {"enabled": True, "plugins": ["repeat_loan"], "repeat_loan": {"min_tokens": 50000}}}
    data = arm_config.derive(raw, tmp_path, overrides={"loan.repeat_loan.min_tokens": 300,
                                                       "planner.chunk_tokens": 512})
    written = tomllib.loads(arm_config.dump_toml(data))
    assert written["model"] == {"path": str(tmp_path / "m.gguf"), "expert_pack": "/abs/m.strpack"}
    assert written["runtime"]["lock_dir"] == str(tmp_path / "locks") and written["planner"] == {"chunk_tokens": 512}
    assert written["loan"] == {"enabled": True, "plugins": ["repeat_loan"], "repeat_loan": {"min_tokens": 300}}
    assert raw["loan"]["repeat_loan"]["min_tokens"] == 50000  # the given tables are not changed
    assert "loan" not in arm_config.derive(raw, tmp_path, without=("loan",))

"""Runs the plugin example of docs/plugins.md, installed as a real distribution on sys.path."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fakes import MIB, FakeEngine
from loan_setup import ALL_RESOURCES_MIB, make_config

from strata.engine.loan.admission import admit
from strata.errors import AdmissionError, ConfigError
from strata.plugins import load_plugins

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def example(name: str) -> str:
    match = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w+\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/plugins.md lost its {name} example"
    return match.group(1)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    (tmp_path / "strata_loan_reserve.py").write_text(example("strata_loan_reserve.py"))
    info = tmp_path / "strata_loan_reserve-0.1.0.dist-info"
    info.mkdir()
    pyproject = example("pyproject.toml")
    assert 'loan_reserve = "strata_loan_reserve"' in pyproject
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: strata-loan-reserve\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[strata.plugins]\nloan_reserve = strata_loan_reserve\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def loaded(**loan):
    plugins = ["loan_mtp", "loan_head", "loan_reserve"]
    host, config = load_plugins(make_config(loan={"plugins": plugins, **loan}))
    engine = FakeEngine(config, host, ALL_RESOURCES_MIB)
    admit(config, host, engine.resources)
    engine.loan.start()
    return engine


def test_example_plugin_withholds_budget_and_vetoes_short_prompts(installed):
    engine = loaded(loan_reserve={"reserve": "512MiB", "min_unread_tokens": 8192})
    plain = loaded(loan_reserve={"reserve": 0})
    geometry, report = engine.prefill(100_000)
    assert report.is_taken
    withheld = (plain.prefill(100_000)[0].chunk_tokens - geometry.chunk_tokens) * engine.costs.bytes_per_chunk_token
    assert withheld == pytest.approx(512 * MIB, abs=256 * engine.costs.bytes_per_chunk_token)
    _, short = engine.prefill(20_000, unread_tokens=4_000)
    assert not short.is_taken and "loan_reserve: 4000 unread tokens are too few" in short.reason


def test_example_plugin_table_is_validated(installed):
    with pytest.raises(ConfigError, match="loan.loan_reserve.min_unread_tokens = 10: must be in the range >= 256"):
        loaded(loan_reserve={"min_unread_tokens": 10})


def test_example_plugin_admission(installed):
    host, config = load_plugins(make_config(runtime={"vram_budget": "2GiB"}, loan={"plugins": ["loan_reserve"]}))
    with pytest.raises(AdmissionError, match="loan_reserve needs a budget of at least 4 GiB"):
        admit(config, host, {})


def test_example_appears_in_the_plugins_listing(installed, tmp_path):
    config = tmp_path / "s.toml"
    config.write_text('[model]\npath = "m.gguf"\n[runtime]\nserve = true\nvram_elastic = true\n'
                      '[loan]\nenabled = true\nplugins = ["loan_reserve"]\n')
    out = subprocess.run([sys.executable, "-m", "strata.cli", "--config", str(config), "plugins"],
                         capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": ""}).stdout
    assert ("loan_reserve  [enabled]\n  from:  strata-loan-reserve 0.1.0 (strata_loan_reserve)\n  hooks: "
            "strata_config_tables, strata_loan_admit, strata_loan_decide, strata_planner_budget") in out

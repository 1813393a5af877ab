"""A third-party plugin found through a real entry point: a distribution the test puts on sys.path."""

import importlib
import textwrap

from fakes import MIB, FakeEngine
from loan_setup import make_config

from strata.plugins import describe_plugins, load_plugins

PLUGIN_SOURCE = textwrap.dedent('''
    import dataclasses
    from strata.hooks import hookimpl
    from strata.schema import option

    @dataclasses.dataclass(frozen=True)
    class Options:
        reserve_mib: int = option(64, doc="MiB withheld from the planner", min=0)

    CALLS = []

    @hookimpl
    def strata_config_tables():
        return {"reserve": Options}

    @hookimpl
    def strata_planner_budget(ctx, budget):
        CALLS.append(ctx.request.index)
        return -ctx.config.plugin_options("reserve").reserve_mib * 2**20
''')


def make_distribution(root, name="strata_reserve", plugin="reserve"):
    (root / f"{name}.py").write_text(PLUGIN_SOURCE)
    info = root / f"{name}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[strata.plugins]\n{plugin} = {name}\n")


def test_third_party_plugin_is_discovered_and_runs(tmp_path, monkeypatch):
    make_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    config = make_config(runtime={"mtp": False, "spec_depth": 0},
                         loan={"plugins": ["reserve"], "reserve": {"reserve_mib": 512}})
    host, config = load_plugins(config)
    assert host.names == ("reserve",)
    info = {i.name: i for i in describe_plugins(config)}["reserve"]
    assert info.origin == "strata-reserve 1.2.3 (strata_reserve)"
    assert info.hooks == ("strata_config_tables", "strata_planner_budget")

    engine = FakeEngine(config, host, {})
    engine.loan.start()
    without = engine.loan.planner.plan(engine.loan.budget(), None)
    geometry, report = engine.prefill(100_000)
    assert report.is_taken and importlib.import_module("strata_reserve").CALLS == [0]
    withheld = (without.chunk_tokens - geometry.chunk_tokens) * engine.costs.bytes_per_chunk_token
    assert 512 * MIB - 256 * engine.costs.bytes_per_chunk_token < withheld <= 512 * MIB + 64 * MIB

import textwrap

import pytest
import strata_repeat_loan
from loan_setup import make_config

from strata.cli import main
from strata.errors import PluginError
from strata.hooks import hookimpl
from strata.plugins import (
    bind_tables,
    describe_plugins,
    load_plugins,
    new_host,
    new_manager,
    register,
)

BUILTIN_NAMES = ("loan_mtp", "loan_head", "retain_startup_chunk", "repeat_loan", "cost_gate")


def test_builtins_load_through_entry_points_in_allow_list_order():
    config = make_config(loan={"plugins": ["repeat_loan", "loan_head"]})
    host, bound = load_plugins(config)
    assert host.names == ("repeat_loan", "loan_head")
    assert {name for name, _ in host.pm.list_name_plugin()} == {"repeat_loan", "loan_head"}
    assert bound.plugin_options("repeat_loan").min_tokens == 1024


def test_master_switch_off_loads_nothing():
    config = make_config(loan={"enabled": False, "plugins": None})
    host, _ = load_plugins(config)
    assert host.names == () and host.pm.list_name_plugin() == []


def test_unknown_plugin_fails_listing_the_available_ones():
    with pytest.raises(PluginError, match="loan.plugins names 'loan_kv'.*available plugins: .*loan_head.*loan_mtp"):
        load_plugins(make_config(loan={"plugins": ["loan_kv"]}))


def test_table_for_a_plugin_not_enabled():
    config = make_config(loan={"plugins": ["loan_mtp"]})
    config = config.__class__(**{**config.__dict__, "loan": config.loan.__class__(
        enabled=True, plugins=("loan_mtp",), tables={"repeat_loan": {"min_tokens": 4096}})})
    with pytest.raises(PluginError, match=r"\[loan.repeat_loan\] configures plugin 'repeat_loan', which is not in "
                                          "loan.plugins"):
        load_plugins(config)


def test_a_plugin_declaring_another_plugins_table_is_named():
    class Thief:
        @hookimpl
        def strata_config_tables(self):
            return {"repeat_loan": strata_repeat_loan.RepeatLoanOptions}

    host = new_host({"repeat_loan": strata_repeat_loan, "thief": Thief()})
    with pytest.raises(PluginError, match=r"plugin 'thief' declares the table \[loan.repeat_loan\]"):
        bind_tables(host, make_config(loan={"plugins": ["repeat_loan", "thief"]}))


def test_misspelled_hook_fails_naming_plugin_and_hook():
    class Typo:
        @hookimpl
        def strata_prefill_relase(self, ctx):
            return []

    with pytest.raises(PluginError, match="plugin 'typo' defines strata_prefill_relase, which is not a Strata hook"):
        register(new_manager(), "typo", Typo())


def test_unmarked_hook_is_an_error():
    class Unmarked:
        def strata_prefill_release(self, ctx):
            return []

    with pytest.raises(PluginError, match="plugin 'unmarked' defines strata_prefill_release without @strata.hooks"):
        register(new_manager(), "unmarked", Unmarked())


def test_hook_argument_not_in_the_spec():
    class WrongArgs:
        @hookimpl
        def strata_prefill_release(self, ctx, geometry):
            return []

    with pytest.raises(PluginError, match="(?s)plugin 'wrong' does not match the hook contract.*geometry"):
        register(new_manager(), "wrong", WrongArgs())


def test_plugin_may_take_fewer_arguments_than_the_spec():
    class Fewer:
        @hookimpl
        def strata_loan_admit(self):
            return []

    register(new_manager(), "fewer", Fewer())


def test_describe_lists_origin_hooks_and_state():
    infos = {i.name: i for i in describe_plugins(make_config(loan={"plugins": ["loan_mtp"]}))}
    assert set(BUILTIN_NAMES) <= set(infos)
    assert infos["loan_mtp"].is_enabled and not infos["repeat_loan"].is_enabled
    assert infos["loan_mtp"].origin.startswith("strata-loan-mtp 0.1.0 (strata_loan_mtp)")
    assert infos["repeat_loan"].hooks == ("strata_config_tables", "strata_loan_decide")


def test_plugins_command(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(textwrap.dedent("""
        [model]
        path = "m.gguf"
        [runtime]
        serve = true
        [loan]
        enabled = true
        plugins = ["repeat_loan"]
    """))
    assert main(["--config", str(tmp_path / "s.toml"), "plugins"]) == 0
    out = capsys.readouterr().out
    assert "repeat_loan  [enabled]" in out and "loan_head  [installed, not enabled]" in out
    assert "hooks: strata_config_tables, strata_loan_decide" in out


def test_plugins_command_reports_a_bad_allow_list(tmp_path, capsys):
    (tmp_path / "s.toml").write_text('[model]\npath = "m.gguf"\n[loan]\nenabled = true\nplugins = ["nope"]\n')
    assert main(["--config", str(tmp_path / "s.toml"), "plugins"]) == 2
    assert "loan.plugins names 'nope'" in capsys.readouterr().err

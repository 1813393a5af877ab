"""Configs and plugin hosts for loan tests: the built-in plugins registered as the engine would."""

from __future__ import annotations

import copy
from typing import Any

import strata_cost_gate
import strata_loan_head
import strata_loan_mtp
import strata_repeat_loan
import strata_retain_startup_chunk

from strata.config import parse_config
from strata.plugins import PluginHost, bind_tables, new_host

BUILTINS = {
    "loan_mtp": strata_loan_mtp,
    "loan_head": strata_loan_head,
    "retain_startup_chunk": strata_retain_startup_chunk,
    "repeat_loan": strata_repeat_loan,
    "cost_gate": strata_cost_gate,
}
WRITE_UP_PLUGINS = ["loan_mtp", "loan_head", "retain_startup_chunk", "repeat_loan"]  # the reference configuration's

SERVE_LOAN = {
    "model": {"path": "model.gguf"},
    "runtime": {"serve": True, "vram_elastic": True, "vmm_segment": "64MiB", "mtp": True, "spec_depth": 4,
                "vram_budget": "8GiB"},
    "loan": {"enabled": True, "plugins": list(WRITE_UP_PLUGINS)},
}

ALL_RESOURCES_MIB = {"verifier": 300, "output_head": 600, "mtp_experts": 700, "mtp_draft_head": 200}


def config_dict(**sections: dict[str, Any]) -> dict[str, Any]:
    """SERVE_LOAN with the given sections' keys overridden (a key set to None is removed)."""
    data = copy.deepcopy(SERVE_LOAN)
    for section, values in sections.items():
        target = data.setdefault(section, {})
        for key, value in values.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
    return data


def make_config(**sections: dict[str, Any]):
    """A parsed config; plugin tables stay raw until ``make_host`` or ``load_plugins`` binds them."""
    return parse_config(config_dict(**sections))


def make_host(config, extra: dict[str, object] | None = None) -> tuple[PluginHost, Any]:
    """Register the enabled built-ins (and inline plugins) under their names, as load_plugins does."""
    names = list(config.loan.plugins) if config.loan.enabled else []
    plugins = {**BUILTINS, **(extra or {})}
    host = new_host({name: plugins[name] for name in names})
    return host, bind_tables(host, config)

"""``python -m strata.bench.experiments.uninstalled MODULE ARGS...``: run MODULE as it would run with
the built-in loan plugins uninstalled: the ``default-off`` experiment's second arm.

``pip uninstall`` of a plugin removes its distribution's metadata (so ``importlib.metadata``
lists none of its entry points, and ``strata.plugins.discover`` finds no plugin of that name) and
its module (so an import of it fails). This process does both before it imports MODULE: the
distributions that register the built-in plugins are left out of ``importlib.metadata`` (entry
points, ``distributions``, ``distribution``), and importing their modules raises
``ModuleNotFoundError``. The files stay on disk; nothing else of the environment changes, so both
arms run the same interpreter, packages and Strata tree. Run with ``--uninstalled-python`` the
experiment uses an interpreter of an environment where they are uninstalled instead.
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys
from importlib import metadata

BUILTIN_PLUGINS = ("loan_mtp", "loan_head", "retain_startup_chunk", "repeat_loan", "cost_gate")
ENTRY_POINT_GROUP = "strata.plugins"  # strata.plugins' own: imported from there it would load pluggy first


class _RefuseModules(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (uninstalled for this run)", name=fullname)
        return None


def hide_plugins(names: tuple[str, ...] = BUILTIN_PLUGINS) -> tuple[str, ...]:
    """Leave the distributions registering ``names`` out of this process; returns their names."""
    registering = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name in names]
    hidden = {_normal(ep.dist.name) for ep in registering if ep.dist is not None}
    modules = {ep.module.partition(".")[0] for ep in registering}
    entry_points, distributions, distribution = metadata.entry_points, metadata.distributions, metadata.distribution

    def is_hidden(dist) -> bool:
        return dist is not None and _normal(dist.metadata["Name"] or "") in hidden

    def visible_entry_points(**params):
        return metadata.EntryPoints(ep for ep in entry_points(**params) if not is_hidden(ep.dist))

    def visible_distributions(**params):
        return (dist for dist in distributions(**params) if not is_hidden(dist))

    def visible_distribution(name):
        if _normal(name) in hidden:
            raise metadata.PackageNotFoundError(name)
        return distribution(name)

    metadata.entry_points, metadata.distributions = visible_entry_points, visible_distributions
    metadata.distribution = visible_distribution
    sys.meta_path.insert(0, _RefuseModules(modules))
    return tuple(sorted(hidden))


def _normal(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m strata.bench.experiments.uninstalled MODULE [ARGS...]")
    hide_plugins()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

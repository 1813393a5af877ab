"""The plugin manager: built-in and third-party plugins load the same way, through entry points.

Every plugin is a distribution that registers an object (usually a module) under the entry-point
group ``strata.plugins``. ``loan.plugins`` in the TOML is the allow-list and the call order.
"""

from __future__ import annotations

import dataclasses
import inspect
from importlib import metadata
from typing import Any, Mapping

import pluggy

from strata import hooks
from strata.config import Config, bind_plugin_tables
from strata.errors import PluginError

ENTRY_POINT_GROUP = "strata.plugins"


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    name: str
    origin: str  # "distribution version (entry point value)"
    hooks: tuple[str, ...]
    is_enabled: bool


@dataclasses.dataclass
class PluginHost:
    """The loaded, enabled plugins and their manager; calls hooks in allow-list order."""

    pm: pluggy.PluginManager
    names: tuple[str, ...]

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def call_in_order(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Every implementation's result with the plugin's name, in ``loan.plugins`` order."""
        results = []
        for impl in self._ordered(hook_name):
            try:
                results.append((impl.plugin_name, _call_impl(impl, kwargs)))
            except Exception as exc:
                raise PluginError(f"plugin {impl.plugin_name!r} failed in {hook_name}: {exc!r}") from exc
        return results

    def call_reversed(self, hook_name: str, **kwargs: Any) -> list[tuple[str, BaseException]]:
        """Call in reverse order; every implementation runs even if one raises. Returns the failures."""
        failures = []
        for impl in reversed(self._ordered(hook_name)):
            try:
                _call_impl(impl, kwargs)
            except Exception as exc:  # reported by the caller after all have run
                failures.append((impl.plugin_name, exc))
        return failures

    def _ordered(self, hook_name: str) -> list[pluggy.HookImpl]:
        rank = {name: i for i, name in enumerate(self.names)}
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        return sorted(impls, key=lambda impl: rank.get(impl.plugin_name, len(rank)))


def _call_impl(impl: pluggy.HookImpl, kwargs: Mapping[str, Any]) -> Any:
    return impl.function(*(kwargs[name] for name in impl.argnames))


def new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hooks.PROJECT)
    pm.add_hookspecs(hooks)
    return pm


def discover() -> dict[str, metadata.EntryPoint]:
    """Installed plugins by name. Two distributions claiming one name is an error."""
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            raise PluginError(f"two installed distributions register the plugin name {ep.name!r} "
                              f"({_origin(found[ep.name])} and {_origin(ep)}); uninstall one")
        found[ep.name] = ep
    return found


def load_plugins(config: Config) -> tuple[PluginHost, Config]:
    """Load and validate the allow-listed plugins; return them and the config with plugin tables bound.

    With ``loan.enabled`` false nothing is loaded. Fails naming the plugin for: an unknown name
    (listing the available ones), an import error, a hook implementation that matches no hook
    (naming plugin and hook), and a bad ``[loan.<name>]`` table.
    """
    pm = new_manager()
    names = config.loan.plugins if config.loan.enabled else ()
    available = discover()
    for name in names:
        if name not in available:
            raise PluginError(f"loan.plugins names {name!r}, which no installed distribution provides; "
                              f"available plugins: {', '.join(sorted(available)) or 'none'}")
        register(pm, name, _load_entry_point(available[name]))
    for name in config.loan.tables:
        if name not in names:
            state = "is not in loan.plugins" if name in available else "is not installed"
            raise PluginError(f"[loan.{name}] configures plugin {name!r}, which {state}; add it to "
                              f"loan.plugins or remove the table (available: {', '.join(sorted(available)) or 'none'})")
    host = PluginHost(pm=pm, names=tuple(names))
    return host, bind_tables(host, config)


def bind_tables(host: PluginHost, config: Config) -> Config:
    """Collect each plugin's declared table schema and validate its ``[loan.<name>]`` table."""
    schemas: dict[str, type] = {}
    for plugin_name, declared in host.call_in_order("strata_config_tables"):
        for table_name, schema in (declared or {}).items():
            if table_name != plugin_name:
                raise PluginError(f"plugin {plugin_name!r} declares the table [loan.{table_name}]; a plugin "
                                  f"may only declare its own table [loan.{plugin_name}]")
            schemas[table_name] = schema
    return bind_plugin_tables(config, schemas, list(host.names))


def register(pm: pluggy.PluginManager, name: str, plugin: object) -> None:
    """Register one plugin and check it against the contract now, not at its first call."""
    for attr, value in inspect.getmembers(plugin):
        if attr.startswith(f"{hooks.PROJECT}_") and callable(value) and not hasattr(pm.hook, attr):
            raise PluginError(f"plugin {name!r} defines {attr}, which is not a Strata hook; "
                              f"hooks are: {', '.join(hook_names())}")
        if attr.startswith(f"{hooks.PROJECT}_") and callable(value) and pm.parse_hookimpl_opts(plugin, attr) is None:
            raise PluginError(f"plugin {name!r} defines {attr} without @strata.hooks.hookimpl; mark it")
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {name!r} does not match the hook contract: {exc}") from exc


def hook_names() -> list[str]:
    return sorted(n for n in dir(hooks) if n.startswith(f"{hooks.PROJECT}_"))


def describe_plugins(config: Config) -> list[PluginInfo]:
    """Every installed plugin: where it came from, the hooks it implements, whether it is enabled."""
    enabled = set(config.loan.plugins) if config.loan.enabled else set()
    infos = []
    for name, ep in sorted(discover().items()):
        plugin = _load_entry_point(ep)
        implemented = tuple(h for h in hook_names() if callable(getattr(plugin, h, None)))
        infos.append(PluginInfo(name=name, origin=_origin(ep), hooks=implemented, is_enabled=name in enabled))
    return infos


def _load_entry_point(ep: metadata.EntryPoint) -> object:
    try:
        plugin = ep.load()
    except Exception as exc:
        raise PluginError(f"plugin {ep.name!r} ({_origin(ep)}) failed to import: {exc!r}") from exc
    return plugin() if inspect.isclass(plugin) else plugin


def _origin(ep: metadata.EntryPoint) -> str:
    dist = ep.dist
    where = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
    return f"{where} ({ep.value})"

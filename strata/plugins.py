"""The plugin manager: built-in and third-party plugins load the same way, through entry points.

Every plugin is a distribution that registers an object (usually a module) under the entry-point
group ``strata.plugins``. ``loan.plugins`` in the TOML is the allow-list and the call order.
"""

from __future__ import annotations

import dataclasses
import inspect
import traceback
from importlib import metadata
from typing import Any, Mapping, Sequence

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


@dataclasses.dataclass(frozen=True)
class PluginHost:
    """The enabled plugins on their manager; every hook call goes through pluggy.

    pluggy calls the implementation registered last first, so ``new_host`` registers the plugins in
    reverse ``loan.plugins`` order: a plain call then runs them in allow-list order, and pluggy's
    ``firstresult``, ``tryfirst``/``trylast``, wrappers and opt-in arguments apply on top.
    """

    pm: pluggy.PluginManager
    names: tuple[str, ...]

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def call(self, hook_name: str, **kwargs: Any) -> Any:
        """One pluggy call: the non-None results in call order, or the first one for a firstresult hook.

        An exception escaping an implementation becomes a ``PluginError`` naming its plugin.
        """
        try:
            return getattr(self.pm.hook, hook_name)(**kwargs)
        except Exception as exc:
            raise PluginError(f"{name_plugins(self._raisers(hook_name, exc))} failed in {hook_name}: "
                              f"{exc!r}") from exc

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """One pluggy call per plugin, in allow-list order: each plugin's results with its name."""
        results = []
        for name, caller in self._plugin_callers(hook_name):
            try:
                results.append((name, caller(**kwargs)))
            except Exception as exc:
                raise PluginError(f"plugin {name!r} failed in {hook_name}: {exc!r}") from exc
        return results

    def call_each_reversed(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Exception]]:
        """One pluggy call per plugin, in reverse allow-list order; every plugin's runs even if one
        raises. Returns the failures."""
        failures = []
        for name, caller in reversed(self._plugin_callers(hook_name)):
            try:
                caller(**kwargs)
            except Exception as exc:  # reported by the caller after all have run
                failures.append((name, exc))
        return failures

    def implementers(self, hook_name: str) -> tuple[str, ...]:
        """The plugins implementing the hook, in allow-list order (any registered outside it last)."""
        found = {impl.plugin_name for impl in getattr(self.pm.hook, hook_name).get_hookimpls()}
        rank = {name: i for i, name in enumerate(self.names)}
        return tuple(sorted(found, key=lambda name: (rank.get(name, len(rank)), name)))

    def _plugin_callers(self, hook_name: str) -> list[tuple[str, pluggy.HookCaller]]:
        registered = {name: plugin for name, plugin in self.pm.list_name_plugin() if plugin is not None}
        return [(name, self.pm.subset_hook_caller(hook_name, [p for n, p in registered.items() if n != name]))
                for name in self.implementers(hook_name)]

    def _raisers(self, hook_name: str, exc: Exception) -> tuple[str, ...]:
        """The plugins whose implementation runs in the innermost traceback frame that runs one
        (several when plugins share a function's code); none when pluggy itself raised."""
        by_code: dict[object, list[str]] = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            by_code.setdefault(getattr(impl.function, "__code__", None), []).append(impl.plugin_name)
        matched = [by_code[frame.f_code] for frame, _ in traceback.walk_tb(exc.__traceback__)
                   if frame.f_code in by_code]
        return tuple(matched[-1]) if matched else ()


def name_plugins(names: Sequence[str]) -> str:
    """``plugin 'a'`` or ``plugin 'a' or 'b'`` for an error about what one of ``names`` did."""
    if not names:
        return "a plugin"
    return f"plugin {' or '.join(repr(name) for name in names)}"


def new_host(plugins: Mapping[str, object]) -> PluginHost:
    """A host for ``plugins`` (name → plugin, in allow-list order), each checked against the contract.

    Registered in reverse, since pluggy calls the last-registered implementation first.
    """
    pm = new_manager()
    for name, plugin in reversed(list(plugins.items())):
        register(pm, name, plugin)
    return PluginHost(pm=pm, names=tuple(plugins))


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
    names = config.loan.plugins if config.loan.enabled else ()
    available = discover()
    loaded = {}
    for name in names:
        if name not in available:
            raise PluginError(f"loan.plugins names {name!r}, which no installed distribution provides; "
                              f"available plugins: {', '.join(sorted(available)) or 'none'}")
        loaded[name] = _load_entry_point(available[name])
    host = new_host(loaded)
    for name in config.loan.tables:
        if name not in names:
            state = "is not in loan.plugins" if name in available else "is not installed"
            raise PluginError(f"[loan.{name}] configures plugin {name!r}, which {state}; add it to "
                              f"loan.plugins or remove the table (available: {', '.join(sorted(available)) or 'none'})")
    return host, bind_tables(host, config)


def bind_tables(host: PluginHost, config: Config) -> Config:
    """Collect each plugin's declared table schema and validate its ``[loan.<name>]`` table."""
    schemas: dict[str, type] = {}
    for plugin_name, results in host.call_each("strata_config_tables"):
        for table_name, schema in (pair for declared in results for pair in declared.items()):
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

"""``strata --config FILE plugins``: every installed plugin, its origin, hooks and whether it is enabled."""

from __future__ import annotations

import argparse

from strata.config import Config
from strata.plugins import describe_plugins, load_plugins


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, config: Config) -> int:
    load_plugins(config)  # fail here, as startup would, on a bad allow-list or table
    infos = describe_plugins(config)
    if not infos:
        print("no plugins installed (entry-point group strata.plugins)")
    for info in infos:
        state = "enabled" if info.is_enabled else "installed, not enabled"
        print(f"{info.name}  [{state}]\n  from:  {info.origin}\n  hooks: {', '.join(info.hooks) or 'none'}")
    return 0

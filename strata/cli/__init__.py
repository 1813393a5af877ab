"""``strata --config FILE [command]``: the main job (serve) and the tools around it."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from strata.errors import StrataError

# command → (module, needs a config, help). Each module has add_arguments(parser) and run(args[, config]).
COMMANDS = {
    "serve": ("strata.serve.main", True, "serve the OpenAI-compatible API (the default command)"),
    "check": ("strata.cli.check", True, "print admission, placement by owner and the plan with and without the loan"),
    "plugins": ("strata.cli.plugins", True, "list installed plugins, where each came from and its hooks"),
    "generate": ("strata.cli.generate", True, "generate text from a prompt in this process"),
    "synth": ("strata.model.synth", False, "write a synthetic MoE GGUF (qwen3moe or llama) with random weights"),
    "pack": ("strata.cli.pack", True, "write the expert pack beside the GGUF"),
    "bench": ("strata.bench.harness", True, "benchmark prefill and decode in fresh processes"),
    "experiment": ("strata.cli.experiment", False, "rerun one of the reference write-up's experiments: "
                                                  "JSON, table and plot in a results folder"),
    "soak": ("strata.bench.soak", True, "many requests of random lengths in one process: device memory and RSS "
                                        "per request and their slope"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description=__doc__,
                                     epilog="Without a command, serve runs and takes its options: "
                                            "strata --config FILE --host H --port P")
    parser.add_argument("--config", metavar="FILE", help="TOML configuration (see configs/)")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (module_name, _, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text)
        command_parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                                    help="TOML configuration (may also come before the command)")
        _module(module_name).add_arguments(command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(with_default_command(argv))
    command = args.command
    module_name, needs_config, _ = COMMANDS[command]
    module = _module(module_name)
    try:
        if not needs_config:
            return module.run(args)
        if not args.config:
            parser.error(f"{command} needs --config FILE (for example configs/demo.toml)")
        from strata.config import load_config

        return module.run(args, load_config(args.config))
    except StrataError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def with_default_command(argv: list[str]) -> list[str]:
    """``serve`` inserted where the command would stand when none is given, so that serve's options
    work without the word: ``strata --config F --port 8084`` is ``strata --config F serve --port 8084``."""
    index = 0
    while index < len(argv) and (argv[index] == "--config" or argv[index].startswith("--config=")):
        index += 2 if argv[index] == "--config" else 1
    rest = argv[index:]
    if rest and (rest[0] in COMMANDS or rest[0] in ("-h", "--help") or not rest[0].startswith("-")):
        return argv  # a command, help, or a word argparse reports as an invalid command
    return [*argv[:index], "serve", *rest]


def _module(name: str):
    return importlib.import_module(name)


if __name__ == "__main__":
    sys.exit(main())

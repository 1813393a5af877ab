"""``strata experiment NAME``: the reference write-up's experiments, rerun from one command.

Each runs its arms in fresh processes (a serving process for ``lifecycle``), interleaved, and
writes ``NAME.json``, ``NAME.md`` (the table) and ``NAME.png`` (the plot) into ``--out``;
``strata experiment render FILE.json`` draws the table and plot again from a JSON. What each
experiment runs and checks: docs/EXPERIMENTS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from strata.bench.experiments import crossover, default_off, fixed_geometry, host_tier, lifecycle, loans
from strata.bench.experiments.results import Results, draw, load_doc, new_doc, write_table
from strata.bench.experiments.context import Setup, check_fits, parse_lengths
from strata.errors import ExperimentError

EXPERIMENTS = {module.NAME: module for module in (default_off, loans, fixed_geometry, lifecycle, crossover,
                                                  host_tier)}
DEFAULT_CONFIG = Path("configs/serve.toml")
MULTI_LENGTH = (crossover.NAME,)  # the others run one prompt length


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="experiment", metavar="NAME", required=True)
    for name, module in EXPERIMENTS.items():
        command = sub.add_parser(name, help=module.HELP.replace("%", "%%"), description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        defaults = module.DEFAULTS
        command.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                             help=f"TOML configuration of the arms (default {DEFAULT_CONFIG}, the write-up's)")
        command.add_argument("--out", type=Path, help=f"results folder (default results/{name})")
        command.add_argument("--prompt-tokens", default=defaults["prompt_tokens"],
                             help=("prompt lengths, comma-separated, k = 1,024" if name in MULTI_LENGTH else
                                   "prompt length") + f" (default {defaults['prompt_tokens']})")
        command.add_argument("--gen-tokens", type=int, default=defaults["gen_tokens"],
                             help=f"tokens generated per request (default {defaults['gen_tokens']})")
        command.add_argument("--reps", type=int, default=defaults["reps"],
                             help=("fresh processes of the long prompt alone, for the decode comparison"
                                   if name == lifecycle.NAME else "fresh processes per arm")
                             + f" (default {defaults['reps']})")
        command.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run (default 1800)")
        module.add_arguments(command)
    render = sub.add_parser("render", help="draw the table and plot again from an experiment's JSON")
    render.add_argument("json", type=Path, metavar="FILE.json", help="the JSON an experiment wrote")
    render.add_argument("--out", type=Path, help="folder for the table and plot (default: the JSON's)")


def run(args: argparse.Namespace) -> int:
    if args.experiment == "render":
        doc = load_doc(args.json)
        if doc["experiment"] not in EXPERIMENTS:
            raise ExperimentError(f"{args.json} holds experiment {doc['experiment']!r}; known: "
                                  f"{', '.join(EXPERIMENTS)}")
        return _finish(EXPERIMENTS[doc["experiment"]], doc, args.out or args.json.parent)
    module = EXPERIMENTS[args.experiment]
    config_path = Path(getattr(args, "config", None) or DEFAULT_CONFIG)
    if not config_path.is_file():
        raise ExperimentError(f"no configuration at {config_path}: pass --config FILE (the write-up's is "
                              f"{DEFAULT_CONFIG} in Strata's source tree)")
    lengths = parse_lengths(args.prompt_tokens)
    if len(lengths) > 1 and module.NAME not in MULTI_LENGTH:
        raise ExperimentError(f"{module.NAME} runs one prompt length; --prompt-tokens {args.prompt_tokens!r} gives "
                              f"{len(lengths)} (crossover runs several)")
    if args.reps < 1 or args.gen_tokens < 1:
        raise ExperimentError(f"--reps {args.reps} and --gen-tokens {args.gen_tokens}: each must be at least 1")
    out = args.out or Path("results") / module.NAME
    options = {k: v for k, v in vars(args).items() if k not in ("command", "experiment", "config", "out")}
    results = Results(out, new_doc(module.NAME, config_path, {**options, "prompt_tokens": lengths}))
    setup = Setup.open(config_path, results)
    if module.NAME not in MULTI_LENGTH:
        check_fits(lengths, args.gen_tokens, setup.config.runtime.context_tokens, str(config_path))
    try:
        module.run(args, setup, lengths)
    except (ExperimentError, KeyboardInterrupt) as exc:
        results.doc["error"] = str(exc) or type(exc).__name__
        results.save()
        if results.doc["runs"] or results.doc.get("requests"):
            print(f"stopped: the runs so far are in {results.path('.json')}; `strata experiment render` draws them",
                  file=sys.stderr)
        raise
    return _finish(module, results.doc, out)


def _finish(module, doc: dict, out: Path) -> int:
    print(write_table(module, doc, out))
    png = draw(module, doc, out)
    print(f"written: {out / (doc['experiment'] + '.json')}, {out / (doc['experiment'] + '.md')}, {png}")
    return 0

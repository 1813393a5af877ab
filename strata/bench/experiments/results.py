"""An experiment's results folder: ``<name>.json`` (every run, rewritten after each, so that a later
failure keeps the runs before it), ``<name>.md`` (the table in the write-up's format, under a line
naming date, commit, device and configuration) and ``<name>.png`` (the plot; needs matplotlib).

The table, verdict and plot are computed from the JSON alone, so ``strata experiment render
FILE.json`` draws them again without running anything.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from strata.bench.provenance import code_identity
from strata.errors import ExperimentError

PLOT_EXTRA = "pip install strata[plot]"


def new_doc(name: str, config_path: Path, options: dict) -> dict:
    return {"experiment": name, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "code": code_identity(), "device": "", "config": str(config_path), "options": options, "arms": [],
            "runs": []}


class Results:
    def __init__(self, out_dir: Path, doc: dict):
        self.out_dir = out_dir
        self.doc = doc

    def path(self, suffix: str) -> Path:
        return self.out_dir / f"{self.doc['experiment']}{suffix}"

    def record(self, run: dict) -> None:
        self.doc["runs"].append(run)
        if not self.doc["device"] and run.get("device"):
            self.doc["device"] = run["device"]
        self.save()

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path(".json").write_text(json.dumps(self.doc, indent=1) + "\n", encoding="utf-8")


def write_table(experiment, doc: dict, out_dir: Path) -> str:
    """The summary into the JSON, the table into ``<name>.md``; returns the table's text."""
    results = Results(out_dir, doc)
    doc["summary"] = experiment.summarize(doc)
    results.save()
    text = f"{header(doc)}\n\n{experiment.table(doc)}\n\n{doc['summary']['verdict']}\n"
    results.path(".md").write_text(text, encoding="utf-8")
    return text


def draw(experiment, doc: dict, out_dir: Path) -> Path:
    """The plot into ``<name>.png``; an ``ExperimentError`` naming the ``plot`` extra when matplotlib
    is missing (call it after ``write_table``: the JSON and table are kept)."""
    results = Results(out_dir, doc)
    plt = pyplot(written=[results.path(".json"), results.path(".md")])
    figure = experiment.plot(doc, plt)
    figure.suptitle(f"{doc['experiment']}: {_commit(doc)}, {doc['device'] or 'device unknown'}, {doc['date']}",
                    fontsize=9)
    figure.savefig(results.path(".png"), dpi=120, bbox_inches="tight")
    plt.close(figure)
    return results.path(".png")


def load_doc(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExperimentError(f"cannot read results {path}: {exc}") from exc
    if not isinstance(doc, dict) or not {"experiment", "runs", "options"} <= set(doc):
        raise ExperimentError(f"{path} is not the JSON of a strata experiment (it needs the keys experiment, "
                              "options and runs)")
    return doc


def header(doc: dict) -> str:
    options = doc["options"]
    lengths = ", ".join(f"{n:,}" for n in options.get("prompt_tokens", []))
    return (f"**{doc['experiment']}** · {doc['date']} · {_commit(doc)} · {doc['device'] or 'device unknown'} · "
            f"`{Path(doc['config']).name}` · prompt {lengths} tokens, {options.get('gen_tokens', 0):,} generated, "
            f"{options.get('reps', 1)} fresh process(es) per arm" + (f" · stopped early: {doc['error']}"
                                                                     if doc.get("error") else ""))


def pyplot(written: list[Path]):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ExperimentError(f"the plot needs matplotlib, which is not installed: {PLOT_EXTRA} "
                              f"({', '.join(str(p) for p in written)} written; `strata experiment render` "
                              "draws the plot from the JSON afterwards)") from exc
    return plt


def _commit(doc: dict) -> str:
    """``strata <commit>[+changes]``: the code line without the folder it was imported from."""
    return doc.get("code", "").split(" at ")[0] or "strata (commit unknown)"

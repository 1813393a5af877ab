"""The table and plot of an experiment of arms at one prompt length (default-off, loans,
fixed-geometry), in the write-up's format: Configuration | Prompt chunk / ring | PP median (range) |
TG median (range)."""

from __future__ import annotations

from typing import Callable, Sequence

from strata.bench.experiments.runs import figures, median_range, plans, select

Column = tuple[str, Callable[[list[dict]], str]]  # (heading, cell from an arm's runs)


def arm_rows(doc: dict) -> list[dict]:
    """Per arm, in the experiment's order: its label, plans, and PP and TG medians with ranges."""
    rows = []
    for arm in doc["arms"]:
        runs = select(doc["runs"], arm=arm["name"])
        rows.append({"arm": arm["name"], "label": arm["label"], "runs": runs, "plans": plans(runs),
                     "pp": figures(runs, "prefill_tokens_per_s"), "tg": figures(runs, "decode_tokens_per_s")})
    return rows


def table(doc: dict, columns: Sequence[Column] = ()) -> str:
    headings = ["Configuration", *(h for h, _ in columns), "Prompt chunk / ring", "PP median (range)",
                "TG median (range)"]
    lines = ["| " + " | ".join(headings) + " |", "| --- | " + " | ".join(["---:"] * (len(headings) - 1)) + " |"]
    for row in arm_rows(doc):
        cells = [row["label"], *(cell(row["runs"]) for _, cell in columns), ", ".join(row["plans"]) or "-",
                 median_range(row["pp"]), median_range(row["tg"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(doc: dict, plt):
    """PP and TG per arm: the median as a bar, the range as its error bar, the plan above it."""
    rows = arm_rows(doc)
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "pp", "prefill (PP), tokens/s"), (axes[1], "tg", "decode (TG), tokens/s")):
        medians = [r[key]["median"] for r in rows]
        errors = [[r[key]["median"] - r[key]["min"] for r in rows], [r[key]["max"] - r[key]["median"] for r in rows]]
        bars = ax.bar(range(len(rows)), medians, yerr=errors, capsize=6, color=["#8c8c8c", "#1f77b4", "#2ca02c"][
            :len(rows)])
        for bar, row in zip(bars, rows):
            ax.annotate(f"{row[key]['median']:,.1f}\n{', '.join(row['plans'])}",
                        (bar.get_x() + bar.get_width() / 2, row[key]["max"]), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 4), textcoords="offset points")
        ax.set_xticks(range(len(rows)), [_wrap(r["label"]) for r in rows], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, max(medians + [r[key]["max"] for r in rows] + [1e-9]) * 1.25)
    return figure


def _wrap(label: str, width: int = 22) -> str:
    words, lines = label.split(), [""]
    for word in words:
        if lines[-1] and len(lines[-1]) + 1 + len(word) > width:
            lines.append(word)
        else:
            lines[-1] = f"{lines[-1]} {word}".strip()
    return "\n".join(lines)

"""Draws docs/layers.png, the layer diagram of docs/ARCHITECTURE.md: `python docs/draw_layers.py`.

Needs matplotlib (not a dependency of Strata). Boxes are the packages, arrows the direction of
calls: data flows one way, from the config down to the GPU kernels.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_name("layers.png")
TOP, ENGINE, BACKEND, GPU, SIDE, PLUGIN = "#dbe9f6", "#fde9c9", "#e2f0d9", "#f4d8d8", "#ececec", "#eadcf0"


def box(ax, x, y, w, h, title, body, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor="#444444", linewidth=1.2))
    ax.text(x + w / 2, y + h - 0.18, title, ha="center", va="top", fontsize=11, weight="bold", family="monospace")
    ax.text(x + 0.2, y + h - 0.55, body, ha="left", va="top", fontsize=8.5, family="monospace", linespacing=1.35)


def arrow(ax, start, end, label="", at=None):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color="#333333", lw=1.3))
    if label:
        x, y = at or ((start[0] + end[0]) / 2 + 0.1, (start[1] + end[1]) / 2)
        ax.text(x, y, label, fontsize=8, va="center", family="monospace", color="#333333")


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 9.2))
    ax.set_xlim(0, 12)
    ax.set_ylim(-0.35, 9.2)
    ax.axis("off")

    box(ax, 3.2, 7.6, 2.6, 1.4, "strata/serve", "OpenAI-compatible API\nrequest queue, worker\nmetrics", TOP)
    box(ax, 6.0, 7.6, 2.6, 1.4, "strata/cli", "strata check, pack,\nplugins, generate", TOP)
    box(ax, 8.8, 7.6, 2.9, 1.4, "strata/bench", "fresh-process harness\nkernel benchmarks", TOP)

    box(ax, 3.2, 4.15, 5.4, 2.8, "strata/engine",
        "facade.py   Engine: load, warm-up, generate\n"
        "core        its parts; loading: load's helpers\n"
        "generation  one request: prefix, loan, decode\n"
        "loan/       transaction, admission, state\n"
        "planning/   placement, planner, cost model\n"
        "memory/     expert cache, pack, ring\n"
        "decode/     captured graphs, greedy tail\n"
        "runner      the forward over the ops", ENGINE)

    box(ax, 0.2, 6.35, 2.6, 2.65, "config + plugins",
        "config.py  TOML -> Config\nschema.py  tables\n\nplugins.py  manager\nhooks.py    contract\nhooktypes   values",
        PLUGIN)
    box(ax, 0.2, 4.3, 2.6, 1.65, "plugins/*", "loan_mtp, loan_head\nrepeat_loan\nretain_startup_chunk", PLUGIN)

    box(ax, 3.2, 2.35, 5.4, 1.45, "strata/backend",
        "ops.py: the Ops protocol\nnumpy_ops | cuda_ops (cuda, cudasim) | dry_run", BACKEND)
    box(ax, 3.2, 0.2, 5.4, 1.7, "strata/gpu",
        "ledger, vmm, memory, block_pool, graphs,\ndriver_calls, readback\nkernels/ (Numba) + kernels/cuda/ (C++)", GPU)

    box(ax, 0.2, 0.2, 2.6, 3.6, "strata/model",
        "GGUF reading\nmodel spec\nquant formats\ntokenizer, chat\nsynthetic writer\nNumPy reference\nforward (oracle)",
        SIDE)

    arrow(ax, (4.5, 7.6), (4.9, 6.95), "Engine")
    arrow(ax, (7.3, 7.6), (6.9, 6.95))
    arrow(ax, (9.6, 7.6), (7.8, 6.95))
    arrow(ax, (10.9, 7.6), (8.65, 1.3), "kernels.py,\nvariants.py", at=(9.75, 3.6))
    arrow(ax, (2.8, 6.9), (3.2, 6.2), "hooks", at=(2.35, 6.45))
    arrow(ax, (1.5, 5.95), (1.5, 6.35), "entry points")
    arrow(ax, (5.9, 4.15), (5.9, 3.8), "Ops")
    arrow(ax, (5.9, 2.35), (5.9, 1.9))
    arrow(ax, (3.2, 4.6), (2.8, 3.8))
    arrow(ax, (3.2, 3.0), (2.8, 2.8))
    ax.text(0.2, -0.2, "arrows: who calls whom; data flows one way, config -> plugin manager -> engine -> backend -> gpu",
            fontsize=8.5, family="monospace", color="#555555")

    fig.savefig(OUT, dpi=110, bbox_inches="tight")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

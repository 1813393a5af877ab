"""The rival's figures the bench table divides by: llama.cpp on the same machine and model shape, with its
experts in host RAM (``-ot exps=CPU``) and with the whole model in VRAM.

The promise is a ratio to llama.cpp measured on the same machine in the same run: ``bench --rival FILE``
reads the table ``llama-bench`` printed there (``peer-llamacpp bench``'s output); without it the table
divides by the figures of an earlier run on the reference H200 and says so, for the model those figures are of
(the synthetic Qwen3-30B-A3B Q4_0) only: another model's table has no rival figures.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from strata.errors import ExperimentError

_TEST = re.compile(r"^(pp|tg)(\d+)$")
_RATE = re.compile(r"^([\d.]+)(?:\s*±\s*[\d.]+)?$")
_EXPERTS_ON_CPU = re.compile(r"exps[^|]*=CPU")  # -ot exps=CPU, -ot ".ffn_.*_exps.=CPU", ...


@dataclasses.dataclass(frozen=True)
class Rival:
    source: str
    prefill: dict[int, float]  # prompt tokens -> tokens/s, experts in host RAM
    decode: float | None
    vram_prefill: dict[int, float]  # the whole model in VRAM
    vram_decode: float | None


# llama.cpp on the reference H200 and the synthetic Qwen3-30B-A3B Q4_0, 2026-12-01 (docs/PERFORMANCE.md)
EARLIER_RUN = Rival("llama.cpp on the reference H200, 2026-12-01 (not this run)", {2048: 4394.0, 32768: 4739.0},
                    32.4, {2048: 12042.0, 32768: 8685.0}, 316.0)
EARLIER_RUN_MODEL = "qwen3moe, 2048 hidden, 128 experts, MOSTLY_Q4_0"


def model_identity(path: Path) -> str:
    """The architecture, hidden size, expert count and file type of a GGUF: what the earlier run's figures must
    match to divide by (its MTP block, which llama.cpp's file lacked, does not count)."""
    from gguf import LlamaFileType

    from strata.model.gguf_file import open_reader
    from strata.model.metadata import field_value

    reader = open_reader(path)

    def value(key: str):
        return field_value(reader, reader.fields[key]) if key in reader.fields else None

    arch = value("general.architecture")
    file_type = value("general.file_type")
    kind = LlamaFileType(file_type).name if file_type in set(LlamaFileType) else f"file type {file_type}"
    return f"{arch}, {value(f'{arch}.embedding_length')} hidden, {value(f'{arch}.expert_count') or 0} experts, {kind}"


def parse_llama_bench(text: str, source: str) -> Rival:
    """The pp<N> and tg<N> rows of llama-bench's Markdown table: a row that keeps experts on the CPU (an override
    of ``exps`` tensors to ``CPU``, or a nonzero ``n_cpu_moe`` column) is an experts-in-RAM figure, any other an
    all-in-VRAM one; of several rows of one kind and length (a batch-size sweep), the best."""
    prefill: dict[int, float] = {}
    vram_prefill: dict[int, float] = {}
    decode: dict[bool, float] = {}
    header: list[str] = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if "test" in cells and "t/s" in cells:
            header = cells
            continue
        tests = [match for match in map(_TEST.match, cells) if match]
        rate = _RATE.match(cells[-1]) if cells else None
        if not tests or rate is None:
            continue
        is_ram = any(_EXPERTS_ON_CPU.search(cell) for cell in cells) or _cpu_moe_layers(header, cells) > 0
        kind, num_tokens, value = tests[-1].group(1), int(tests[-1].group(2)), float(rate.group(1))
        if kind == "pp":
            figures = prefill if is_ram else vram_prefill
            figures[num_tokens] = max(value, figures.get(num_tokens, 0.0))
        else:
            decode[is_ram] = max(value, decode.get(is_ram, 0.0))
    if not prefill and not vram_prefill and not decode:
        raise ExperimentError(f"{source}: no llama-bench pp/tg rows found; pass the table that llama-bench (or "
                          "peer-llamacpp bench) printed")
    return Rival(source, prefill, decode.get(True), vram_prefill, decode.get(False))


def _cpu_moe_layers(header: list[str], cells: list[str]) -> int:
    """The row's n_cpu_moe (--n-cpu-moe: the first N layers' experts on the CPU), 0 where the table has none."""
    if "n_cpu_moe" not in header or len(cells) != len(header):
        return 0
    value = cells[header.index("n_cpu_moe")]
    return int(value) if value.isdigit() else 0


def read_rival(path: Path | None, model_path: Path | None = None) -> Rival:
    """--rival's table; without one, the earlier run's figures where the model is theirs (model_path's
    model_identity), else no figures, with a source line that says to pass --rival."""
    if path is None:
        try:
            identity = model_identity(model_path) if model_path is not None else None
        except Exception as exc:  # an unreadable model fails in the runs, with their own message
            identity = f"unreadable: {exc}"
        if identity == EARLIER_RUN_MODEL:
            return EARLIER_RUN
        return Rival(f"none: the earlier run's figures are of another model ({EARLIER_RUN_MODEL}; this one: "
                     f"{identity}); pass --rival with llama-bench's table from this machine and run", {}, None, {},
                     None)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ExperimentError(f"--rival {path}: cannot read it ({reason}); pass the file that peer-llamacpp "
                              "bench wrote") from None
    return parse_llama_bench(text, str(path))

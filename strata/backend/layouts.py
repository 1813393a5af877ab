"""Where an expert's matrices sit inside an expert slot, in the GGUF encoding or a backend's packed one."""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.backend.ops import ExpertLayout
from strata.model.gguf_file import GgufModel

ALIGN_BYTES = 256
EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expert_layout(model: GgufModel, encoded_bytes: Callable[[QType, tuple[int, int]], int] | None = None,
                  encoding: str = "gguf") -> ExpertLayout:
    """Where gate, up and down sit in a slot. ``encoded_bytes(qtype, shape)`` is the size of one
    matrix in the backend's encoding (default: the GGUF bytes)."""
    refs = [model.tensors[f"blk.0.{name}.weight"] for name in EXPERT_MATRICES]
    shapes = tuple(tuple(r.shape[1:]) for r in refs)
    qtypes = tuple(QType(r.qtype) for r in refs)
    sizes = tuple(encoded_bytes(q, s) if encoded_bytes else r.nbytes // r.shape[0]
                  for q, s, r in zip(qtypes, shapes, refs))
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += align(size)
    return ExpertLayout(qtypes=qtypes, shapes=shapes, offsets=tuple(offsets), sizes=sizes, slot_bytes=offset,
                        encoding=encoding)


def packed_expert_layout(model) -> ExpertLayout:
    """Slots holding each matrix's packed planes (quants, scales, extra) one after the other."""
    from strata.gpu.kernels.packing import plane_shapes

    def encoded_bytes(qtype, shape) -> int:
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in plane_shapes(qtype.name, *shape).values())

    return expert_layout(model, encoded_bytes, encoding="packed-planes")


def align(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES

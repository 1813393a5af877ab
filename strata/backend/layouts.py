"""Where an expert's matrices sit inside an expert slot, in the GGUF encoding or a backend's packed one.

One slot geometry serves every main layer: a matrix whose type changes between layers (llama.cpp's
Q4_K_M, Q5_K_M and IQ4_XS mixes give some layers' ffn_down_exps more bits) gets a region that holds
the largest of its types, so any cache slot takes any layer's expert. The MTP block's experts have a
geometry of their own (their arena's).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.backend.ops import ExpertLayout, region_qtypes
from strata.errors import ModelFormatError
from strata.model import quants
from strata.model.gguf_file import GgufModel

ALIGN_BYTES = 256
EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

# (qtype, [rows, cols], every type the matrix's region holds) -> bytes of the matrix in that region
EncodedBytes = Callable[[QType, tuple[int, int], tuple[QType, ...]], int]


def expert_layout(model: GgufModel, encoded_bytes: EncodedBytes | None = None, encoding: str = "gguf",
                  is_mtp: bool = False) -> ExpertLayout:
    """Where gate, up and down sit in a slot, for the experts of every main layer (the cache's and the
    pack's slots), or with ``is_mtp`` of the first MTP block, whose experts live in an arena of their own:
    their types never widen the main layers' slots. ``encoded_bytes`` is the size of one matrix in the
    backend's encoding (default: the GGUF bytes)."""
    spec = model.spec
    layers = range(spec.num_layers, spec.num_layers + 1) if is_mtp else range(spec.num_layers)
    names = [[f"blk.{layer}.{name}.weight" for name in EXPERT_MATRICES] for layer in layers]
    refs = [model.tensors[n] for n in names[0]]
    shapes = tuple(tuple(r.shape[1:]) for r in refs)
    layer_qtypes = [tuple(QType(model.tensors[n].qtype) for n in layer) for layer in names]
    regions = region_qtypes(layer_qtypes)

    def size(index: int, qtype: QType) -> int:
        shape = shapes[index]
        if encoded_bytes:
            return encoded_bytes(qtype, shape, regions[index])
        return shape[0] * quants.row_nbytes(qtype, shape[1])

    per_layer = tuple((qtypes, tuple(size(i, q) for i, q in enumerate(qtypes))) for qtypes in layer_qtypes)
    offsets, offset = [], 0
    for index, qtypes in enumerate(regions):
        offsets.append(offset)
        offset += align(max(size(index, q) for q in qtypes))
    return ExpertLayout(qtypes=per_layer[0][0], shapes=shapes, offsets=tuple(offsets), sizes=per_layer[0][1],
                        slot_bytes=offset, encoding=encoding, layers=per_layer, first_layer=layers.start)


def packed_expert_layout(model, is_mtp: bool = False) -> ExpertLayout:
    """Slots holding each matrix's packed planes (quants, scales, extra) one after the other, each plane
    as wide as the widest of the matrix's types."""
    from strata.gpu.kernels.packing import shared_plane_shapes

    def encoded_bytes(qtype, shape, regions) -> int:
        try:
            planes = shared_plane_shapes([q.name for q in regions], *shape)
        except ValueError as exc:  # a float type in some layers, a quantized one in others
            raise ModelFormatError(f"{model.path}: routed experts: {exc}; convert those experts to one type, "
                                   "or run them on the numpy backend") from exc
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in planes.values())

    return expert_layout(model, encoded_bytes, encoding="packed-planes", is_mtp=is_mtp)


def align(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES

"""The expert pack: every (layer, expert)'s three matrices contiguous in host memory, one DMA each.

In a GGUF, an expert's gate, up and down rows sit in three tensors far apart; streaming one expert
would take three copies. The pack lays each expert out as one slot of ``layout.slot_bytes``:

    [gate rows | pad to 256 B | up rows | pad | down rows | pad]      (raw GGUF bytes)

``strata pack`` writes it to ``<model>.strpack`` beside the GGUF (a 4 KiB JSON header, then slots
in (layer, expert) order); the engine reads it into pinned memory, or packs the GGUF in memory at
load when no pack file is configured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.engine.ops import ExpertLayout
from strata.errors import ModelFormatError
from strata.model.gguf_file import GgufModel

ALIGN_BYTES = 256
HEADER_BYTES = 4096
MAGIC = "strata-expert-pack-1"
_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expert_layout(model: GgufModel, encoded_bytes: Callable[[QType, tuple[int, int]], int] | None = None,
                  encoding: str = "gguf") -> ExpertLayout:
    """Where gate, up and down sit in a slot. ``encoded_bytes(qtype, shape)`` is the size of one
    matrix in the backend's encoding (default: the GGUF bytes)."""
    refs = [model.tensors[f"blk.0.{name}.weight"] for name in _MATRICES]
    shapes = tuple(tuple(r.shape[1:]) for r in refs)
    qtypes = tuple(QType(r.qtype) for r in refs)
    sizes = tuple(encoded_bytes(q, s) if encoded_bytes else r.nbytes // r.shape[0]
                  for q, s, r in zip(qtypes, shapes, refs))
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += _align(size)
    return ExpertLayout(qtypes=qtypes, shapes=shapes, offsets=tuple(offsets), sizes=sizes, slot_bytes=offset,
                        encoding=encoding)


class ExpertPack:
    """Host copies of all routed experts of the main layers: ``slot(layer, expert)`` is one DMA source."""

    def __init__(self, layout: ExpertLayout, num_layers: int, num_experts: int, buffer: np.ndarray):
        self.layout = layout
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.buffer = buffer  # [num_layers * num_experts * slot_bytes] uint8, pinned on CUDA

    @property
    def num_bytes(self) -> int:
        return self.num_layers * self.num_experts * self.layout.slot_bytes

    def slot(self, layer: int, expert: int) -> np.ndarray:
        start = (layer * self.num_experts + expert) * self.layout.slot_bytes
        return self.buffer[start:start + self.layout.slot_bytes]

    @classmethod
    def from_gguf(cls, model: GgufModel, layout: ExpertLayout, allocate: Callable[[int], np.ndarray],
                  encode: Callable[[np.ndarray, QType, tuple[int, int]], np.ndarray] | None = None,
                  progress: Callable[[int], None] | None = None) -> ExpertPack:
        """Pack every layer's experts; ``encode(raw [N, rows, row_bytes], qtype, shape) -> [N, size]``
        turns GGUF bytes into the backend's encoding (default: kept as they are)."""
        spec = model.spec
        pack = cls(layout, spec.num_layers, spec.num_experts,
                   allocate(spec.num_layers * spec.num_experts * layout.slot_bytes))
        for layer in range(spec.num_layers):
            _check_layer_layout(model, layer, layout)
            slots = pack.buffer[layer * spec.num_experts * layout.slot_bytes:
                                (layer + 1) * spec.num_experts * layout.slot_bytes].reshape(spec.num_experts, -1)
            for name, qtype, shape, offset, size in zip(_MATRICES, layout.qtypes, layout.shapes, layout.offsets,
                                                        layout.sizes):
                data = model.tensors[f"blk.{layer}.{name}.weight"].data  # [N, rows, row_bytes]
                encoded = encode(data, qtype, shape) if encode else data.reshape(spec.num_experts, -1)
                slots[:, offset:offset + size] = encoded  # [N, size] bytes, one strided copy per matrix
            if progress:
                progress(layer + 1)
        return pack

    def write(self, path: Path, source: Path) -> None:
        header = json.dumps({"magic": MAGIC, "source": source.name, "num_layers": self.num_layers,
                             "num_experts": self.num_experts, **_layout_json(self.layout)}).encode()
        if len(header) >= HEADER_BYTES:
            raise ValueError("expert pack header too long")
        with open(path, "wb") as f:
            f.write(header.ljust(HEADER_BYTES, b"\0"))
            for layer in range(self.num_layers):
                start = layer * self.num_experts * self.layout.slot_bytes
                f.write(memoryview(self.buffer[start:start + self.num_experts * self.layout.slot_bytes]))

    @classmethod
    def read(cls, path: Path, model: GgufModel, layout: ExpertLayout,
             allocate: Callable[[int], np.ndarray]) -> ExpertPack:
        """Load a pack written for ``model`` in ``layout`` into memory from ``allocate`` (pinned on CUDA)."""
        spec = model.spec
        try:
            with open(path, "rb") as f:
                header = json.loads(f.read(HEADER_BYTES).rstrip(b"\0"))
                expected = {"magic": MAGIC, "num_layers": spec.num_layers, "num_experts": spec.num_experts,
                            **_layout_json(layout)}
                wrong = {k: header.get(k) for k, v in expected.items() if header.get(k) != v}
                if wrong:
                    raise ModelFormatError(f"{path}: expert pack does not match {model.path.name}: {wrong}; "
                                           "rewrite it with `strata pack`")
                pack = cls(layout, spec.num_layers, spec.num_experts,
                           allocate(spec.num_layers * spec.num_experts * layout.slot_bytes))
                if f.readinto(memoryview(pack.buffer)) != pack.num_bytes:
                    raise ModelFormatError(f"{path}: expert pack is truncated; rewrite it with `strata pack`")
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"{path}: cannot read expert pack: {exc}") from exc
        return pack


def _check_layer_layout(model: GgufModel, layer: int, layout: ExpertLayout) -> None:
    for name, qtype in zip(_MATRICES, layout.qtypes):
        ref = model.tensors[f"blk.{layer}.{name}.weight"]
        if ref.qtype != qtype:
            raise ModelFormatError(f"{model.path}: blk.{layer}.{name}.weight is {ref.qtype.name}; the expert pack "
                                   f"needs every layer's experts in the format of layer 0 ({qtype.name})")


def _layout_json(layout: ExpertLayout) -> dict:
    return {"encoding": layout.encoding, "qtypes": [int(q) for q in layout.qtypes],
            "shapes": [list(s) for s in layout.shapes], "offsets": list(layout.offsets), "sizes": list(layout.sizes),
            "slot_bytes": layout.slot_bytes}


def _align(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES

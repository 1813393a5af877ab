"""The expert pack: every (layer, expert)'s three matrices contiguous in host memory, one DMA each.

In a GGUF, an expert's gate, up and down rows sit in three tensors far apart; streaming one expert
would take three copies. The pack lays each expert out as one slot of ``layout.slot_bytes``:

    [gate rows | pad to 256 B | up rows | pad | down rows | pad]      (raw GGUF bytes)

A matrix whose type changes between layers has a region as large as its largest type's (the rest
of a smaller one's is zeros), so one slot size serves every layer.

``strata pack`` writes it to ``<model>.strpack`` beside the GGUF (a 4 KiB JSON header, then slots
in (layer, expert) order); the engine reads it into pinned memory, or packs the GGUF in memory at
load when no pack file is configured. The header records the source GGUF's identity
(``source_identity``), and a pack of another GGUF or another pack format is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.backend.layouts import EXPERT_MATRICES
from strata.backend.ops import ExpertLayout
from strata.errors import ModelFormatError, StaleExpertPackError
from strata.model.gguf_file import GgufModel, check_finite

HEADER_BYTES = 4096
MAGIC_PREFIX = "strata-expert-pack-"
MAGIC = MAGIC_PREFIX + "2"  # 2: the header records the source GGUF's identity
SOURCE_SAMPLE_BYTES = 4096  # of every expert matrix, hashed into the source identity
# (raw [N, rows, row_bytes], qtype, shape, every type the matrix's region holds) -> [N, size] encoded
Encode = Callable[[np.ndarray, QType, tuple[int, int], tuple[QType, ...]], np.ndarray]
REPACK_FIX = "write it again with `strata --config FILE pack` (FILE: the configuration whose model.expert_pack it is)"


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

    def slot_addresses(self, layer: int) -> np.ndarray:
        """[N] uint64 host address of each of ``layer``'s expert slots (in pinned memory on CUDA, where a
        kernel reads them at the same address)."""
        from strata.gpu.driver_calls import host_address

        first = host_address(self.buffer) + layer * self.num_experts * self.layout.slot_bytes
        return first + np.arange(self.num_experts, dtype=np.uint64) * np.uint64(self.layout.slot_bytes)

    @classmethod
    def from_gguf(cls, model: GgufModel, layout: ExpertLayout, allocate: Callable[[int], np.ndarray],
                  encode: Encode | None = None, progress: Callable[[int], None] | None = None) -> ExpertPack:
        """Pack every layer's experts; ``encode(raw [N, rows, row_bytes], qtype, shape, region_qtypes) ->
        [N, size]`` turns GGUF bytes into the backend's encoding (default: kept as they are) for a region
        that holds any of ``region_qtypes``. A matrix holding NaN or infinity is a ``NonFiniteWeightError``
        naming it."""
        spec = model.spec
        pack = cls(layout, spec.num_layers, spec.num_experts,
                   allocate(spec.num_layers * spec.num_experts * layout.slot_bytes))
        for layer in range(spec.num_layers):
            slots = pack.buffer[layer * spec.num_experts * layout.slot_bytes:
                                (layer + 1) * spec.num_experts * layout.slot_bytes].reshape(spec.num_experts, -1)
            pack_layer(model, layer, layout, slots, encode)
            if progress:
                progress(layer + 1)
        return pack

    def write(self, path: Path, model: GgufModel) -> None:
        """Write the pack to ``path``, its header naming ``model`` (the GGUF it was packed from)."""
        header = json.dumps({"magic": MAGIC, "source": str(model.path.resolve()), **source_identity(model),
                             "num_layers": self.num_layers, "num_experts": self.num_experts,
                             **_layout_json(self.layout)}).encode()
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
        """Load a pack written for ``model`` in ``layout`` into memory from ``allocate`` (pinned on CUDA).

        Raises ``StaleExpertPackError`` for a pack of another GGUF, layout or pack format."""
        spec = model.spec
        with _opened(path) as f:
            _check_header(path, _read_header(f), _identity(model), model, layout)
            pack = cls(layout, spec.num_layers, spec.num_experts,
                       allocate(spec.num_layers * spec.num_experts * layout.slot_bytes))
            if f.readinto(memoryview(pack.buffer)) != pack.num_bytes:
                raise ModelFormatError(f"{path}: expert pack is truncated; {REPACK_FIX}")
        return pack

    @staticmethod
    def check(path: Path, model: GgufModel, layout: ExpertLayout) -> None:
        """Refuse, as ``read`` would, a pack that is not ``model``'s in ``layout``, reading its header and
        size only (``strata check``, which loads nothing)."""
        spec = model.spec
        with _opened(path) as f:
            _check_header(path, _read_header(f), _identity(model), model, layout)
            if path.stat().st_size < HEADER_BYTES + spec.num_layers * spec.num_experts * layout.slot_bytes:
                raise ModelFormatError(f"{path}: expert pack is truncated; {REPACK_FIX}")


@contextlib.contextmanager
def _opened(path: Path):
    """The pack file; a file that cannot be read, or whose header is not JSON, is refused with the fix."""
    try:
        with open(path, "rb") as f:
            yield f
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{path}: cannot read expert pack: {exc}; {REPACK_FIX}") from exc


def _read_header(f) -> dict:
    return json.loads(f.read(HEADER_BYTES).rstrip(b"\0"))


def _identity(model: GgufModel) -> dict:
    try:
        return source_identity(model)
    except OSError as exc:
        raise ModelFormatError(f"{model.path}: cannot read the GGUF to check its expert pack: {exc}") from exc


def source_identity(model: GgufModel) -> dict:
    """What ties a pack to its GGUF, cheap for a file of many GB: the file's size, and a SHA-256 of
    its header, metadata and tensor table and of the first bytes of every expert matrix the pack
    copies (a GGUF written again with other weights of the same shape keeps the same header)."""
    digest = hashlib.sha256()
    with open(model.path, "rb") as f:
        digest.update(f.read(model.data_offset_bytes))
    for layer in range(model.spec.num_layers):
        for name in EXPERT_MATRICES:
            data = model.tensors[f"blk.{layer}.{name}.weight"].data
            digest.update(data.reshape(-1).view(np.uint8)[:SOURCE_SAMPLE_BYTES].tobytes())
    return {"source_bytes": model.path.stat().st_size, "source_sha256": digest.hexdigest()}


def _check_header(path: Path, header: dict, identity: dict, model: GgufModel, layout: ExpertLayout) -> None:
    magic = header.get("magic") if isinstance(header, dict) else None
    if not isinstance(magic, str) or not magic.startswith(MAGIC_PREFIX):
        raise ModelFormatError(f"{path}: not an expert pack (no {MAGIC_PREFIX}* header); {REPACK_FIX}")
    if magic != MAGIC:
        raise StaleExpertPackError(f"{path}: expert pack format {magic!r}, this Strata reads {MAGIC!r} (which "
                                   f"records the GGUF a pack was written from); {REPACK_FIX}")
    if {k: header.get(k) for k in identity} != identity:
        raise StaleExpertPackError(
            f"{path} was packed from {header.get('source')} ({_identity_text(header)}), not from {model.path} "
            f"({_identity_text(identity)}): the GGUF changed or is another one; {REPACK_FIX}")
    spec = model.spec
    expected = {"num_layers": spec.num_layers, "num_experts": spec.num_experts, **_layout_json(layout)}
    wrong = {k: header.get(k) for k, v in expected.items() if header.get(k) != v}
    if wrong:
        raise StaleExpertPackError(f"{path}: expert pack does not match {model.path.name} in the "
                                   f"{layout.encoding} encoding: {wrong}; {REPACK_FIX}")


def _identity_text(identity: dict) -> str:
    size = identity.get("source_bytes")
    size_text = f"{size:,} bytes" if isinstance(size, int) else "size unknown"
    return f"{size_text}, sha256 {str(identity.get('source_sha256'))[:16]}"


def pack_layer(model: GgufModel, layer: int, layout: ExpertLayout, slots: np.ndarray,
               encode: Encode | None = None) -> None:
    """Write ``layer``'s experts into ``slots`` [N, slot_bytes], one slot each, in ``layout`` (a model's:
    each matrix in the layer's own type, its region's rest zeros). A matrix holding NaN or infinity is a
    ``NonFiniteWeightError`` naming it."""
    own = layout.at_layer(layer)
    _check_layer_layout(model, layer, own)
    ends = (*layout.offsets[1:], layout.slot_bytes)
    for name, qtype, shape, offset, size, end, region_qtypes in zip(
            EXPERT_MATRICES, own.qtypes, own.shapes, own.offsets, own.sizes, ends, layout.matrix_qtypes):
        ref = model.tensors[f"blk.{layer}.{name}.weight"]
        check_finite(ref, model.path)  # as it is read: a pack holds only finite experts
        data = ref.data  # [N, rows, row_bytes]
        encoded = encode(data, qtype, shape, region_qtypes) if encode else data.reshape(data.shape[0], -1)
        slots[:, offset:offset + size] = encoded  # [N, size] bytes, one strided copy per matrix
        slots[:, offset + size:end] = 0


def _check_layer_layout(model: GgufModel, layer: int, layout: ExpertLayout) -> None:
    for name, qtype in zip(EXPERT_MATRICES, layout.qtypes):
        ref = model.tensors[f"blk.{layer}.{name}.weight"]
        if ref.qtype != qtype:
            raise ModelFormatError(f"{model.path}: blk.{layer}.{name}.weight is {ref.qtype.name}, not the "
                                   f"{qtype.name} of the expert layout it is packed in (another model's layout)")


def _layout_json(layout: ExpertLayout) -> dict:
    layers = {"layers": [[[int(q) for q in qtypes], list(sizes)] for qtypes, sizes in layout.layers]} \
        if layout.is_mixed else {}  # a layout of one type per matrix reads as before
    return {"encoding": layout.encoding, "qtypes": [int(q) for q in layout.qtypes],
            "shapes": [list(s) for s in layout.shapes], "offsets": list(layout.offsets), "sizes": list(layout.sizes),
            "slot_bytes": layout.slot_bytes, **layers}

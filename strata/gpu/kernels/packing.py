"""The packed layout every kernel reads quantized matrices from: GGUF blocks split into planes.

A GGUF row of a block-quantized tensor is a run of blocks, each block a few fp16 scale bytes
followed (or preceded) by quant bytes: 18-byte Q4_0 blocks, 34-byte Q8_0 blocks... Such blocks
are not 4-byte aligned, so a kernel reading them straight would issue byte loads. At load time
each row is split, byte for byte, into three planes so that every load is aligned:

    quants  uint32  [rows, num_blocks * quant_words]   the block's quant bytes, little-endian words
    scales  float16 [rows, num_blocks * scale_halves]  the block's fp16 fields, in block order
    extra   uint8   [rows, num_blocks * extra_bytes]   K-quant sub-block scales, as in the block

Per format (a block = `block_elems` elements, fields in GGUF byte order):

    Q4_0     32 el  scales: d        quants: qs[16]                       extra: -
    Q4_1     32 el  scales: d, m     quants: qs[16]                       extra: -
    Q5_0     32 el  scales: d        quants: qh[4], qs[16]                extra: -
    Q5_1     32 el  scales: d, m     quants: qh[4], qs[16]                extra: -
    Q8_0     32 el  scales: d        quants: qs[32] (int8)                extra: -
    IQ4_NL   32 el  scales: d        quants: qs[16]                       extra: -
    Q4_K    256 el  scales: d, dmin  quants: qs[128]                      extra: scales[12] (6-bit packed)
    Q5_K    256 el  scales: d, dmin  quants: qh[32], qs[128]              extra: scales[12] (6-bit packed)
    Q6_K    256 el  scales: d        quants: ql[128] then qh[64]          extra: scales[16] (int8)
    IQ4_XS  256 el  scales: d        quants: qs[128]                      extra: scales_h[2], scales_l[4]
    IQ3_XXS 256 el  scales: d        quants: qs[64], aux[32]              extra: -
    IQ3_S   256 el  scales: d        quants: qs[64], qh[8], signs[32]     extra: scales[4]
    IQ2_S   256 el  scales: d        quants: qs[32], signs[32], qh[8]     extra: scales[8]
    F16             quants: float16 [rows, cols] (the GGUF bytes as they are)
    BF16            quants: uint16 [rows, cols] (the upper halves of the float32 values)
    F32             quants: float32 [rows, cols]

The total byte count equals the GGUF tensor's; `unpack` restores the GGUF bytes exactly. A plane
a format does not have is a (1, 1) placeholder. Tensors with leading dimensions (expert stacks
[E, N, K]) are flattened to rows: expert e's row n is row e*N + n.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
from numba import cuda

from ._common import check_array


class QuantFormat(NamedTuple):
    name: str
    ggml_type: int
    block_elems: int
    block_bytes: int
    fields: tuple  # ((plane, first byte, end byte), ...) in the block's byte order

    def plane_bytes(self, plane: str) -> int:
        return sum(end - start for p, start, end in self.fields if p == plane)

    @property
    def is_float(self) -> bool:
        return not self.fields


FORMATS = MappingProxyType({
    f.name: f
    for f in (
        QuantFormat("F32", 0, 1, 4, ()),
        QuantFormat("F16", 1, 1, 2, ()),
        QuantFormat("BF16", 30, 1, 2, ()),
        QuantFormat("Q4_0", 2, 32, 18, (("scales", 0, 2), ("quants", 2, 18))),
        QuantFormat("Q4_1", 3, 32, 20, (("scales", 0, 4), ("quants", 4, 20))),
        QuantFormat("Q5_0", 6, 32, 22, (("scales", 0, 2), ("quants", 2, 22))),
        QuantFormat("Q5_1", 7, 32, 24, (("scales", 0, 4), ("quants", 4, 24))),
        QuantFormat("Q8_0", 8, 32, 34, (("scales", 0, 2), ("quants", 2, 34))),
        QuantFormat("IQ4_NL", 20, 32, 18, (("scales", 0, 2), ("quants", 2, 18))),
        QuantFormat("Q4_K", 12, 256, 144, (("scales", 0, 4), ("extra", 4, 16), ("quants", 16, 144))),
        QuantFormat("Q5_K", 13, 256, 176, (("scales", 0, 4), ("extra", 4, 16), ("quants", 16, 176))),
        QuantFormat("Q6_K", 14, 256, 210, (("quants", 0, 192), ("extra", 192, 208), ("scales", 208, 210))),
        QuantFormat("IQ4_XS", 23, 256, 136, (("scales", 0, 2), ("extra", 2, 8), ("quants", 8, 136))),
        QuantFormat("IQ3_XXS", 18, 256, 98, (("scales", 0, 2), ("quants", 2, 98))),
        QuantFormat("IQ3_S", 21, 256, 110, (("scales", 0, 2), ("quants", 2, 106), ("extra", 106, 110))),
        QuantFormat("IQ2_S", 22, 256, 82, (("scales", 0, 2), ("quants", 2, 74), ("extra", 74, 82))),
    )
})
_PLANE_DTYPES = MappingProxyType({"quants": np.uint32, "scales": np.float16, "extra": np.uint8})
_FLOAT_DTYPES = MappingProxyType({"F32": np.float32, "F16": np.float16, "BF16": np.uint16})  # BF16: raw bits


class PackedMatrix(NamedTuple):
    """A [num_rows, num_cols] matrix in the packed layout; planes are host or device arrays."""

    fmt: str
    num_rows: int
    num_cols: int
    quants: Any
    scales: Any
    extra: Any

    @property
    def nbytes(self) -> int:
        f = FORMATS[self.fmt]
        return self.num_rows * (self.num_cols // f.block_elems) * f.block_bytes


def quant_format(fmt: str) -> QuantFormat:
    if fmt not in FORMATS:
        raise ValueError(f"unsupported quant format {fmt!r}; supported: {', '.join(FORMATS)}")
    return FORMATS[fmt]


def plane_shapes(fmt: str, num_rows: int, num_cols: int) -> dict:
    """Shape and dtype of each plane of a [num_rows, num_cols] matrix."""
    f = quant_format(fmt)
    if num_cols % f.block_elems:
        raise ValueError(f"{fmt} rows need a multiple of {f.block_elems} columns, got {num_cols}")
    if f.is_float:
        return {"quants": ((num_rows, num_cols), _FLOAT_DTYPES[fmt])}
    num_blocks = num_cols // f.block_elems
    shapes = {}
    for plane, dtype in _PLANE_DTYPES.items():
        width = f.plane_bytes(plane) // np.dtype(dtype).itemsize
        if width:
            shapes[plane] = ((num_rows, num_blocks * width), dtype)
    return shapes


def shared_plane_shapes(fmts, num_rows: int, num_cols: int) -> dict:
    """The planes that hold a [num_rows, num_cols] matrix of any of ``fmts`` (the expert cache's region
    of a matrix whose format changes between layers): each plane one of them has, as wide as the widest.
    A narrower format's rows are padded at their end: its planes' row pitch is the shared width."""
    shapes: dict = {}
    for fmt in fmts:
        for plane, ((_, width), dtype) in plane_shapes(fmt, num_rows, num_cols).items():
            (_, widest), shared_dtype = shapes.get(plane, ((num_rows, 0), dtype))
            if np.dtype(shared_dtype) != np.dtype(dtype):
                raise ValueError(f"formats {', '.join(fmts)} cannot share planes: their {plane} are "
                                 f"{np.dtype(shared_dtype)} and {np.dtype(dtype)}")
            shapes[plane] = ((num_rows, max(width, widest)), dtype)
    return {plane: shapes[plane] for plane in _PLANE_DTYPES if plane in shapes}


def padded_planes(p: PackedMatrix, shapes: dict) -> dict:
    """The planes of ``p`` (host arrays) at the widths of ``shapes`` (``shared_plane_shapes``), rows
    zero-padded at their end; a plane ``p``'s format lacks is zeros."""
    out = {}
    for plane, ((num_rows, width), dtype) in shapes.items():
        padded = np.zeros((num_rows, width), dtype)
        if plane in plane_shapes(p.fmt, p.num_rows, p.num_cols):
            own = getattr(p, plane)
            padded[:, :own.shape[1]] = own
        out[plane] = padded
    return out


def pack(raw: np.ndarray, fmt: str, num_cols: int | None = None) -> PackedMatrix:
    """Split GGUF tensor bytes `raw` ([..., row_bytes] uint8, or F16/F32 values) into planes."""
    f = quant_format(fmt)
    raw = np.ascontiguousarray(raw)
    if raw.dtype != np.uint8:
        if not f.is_float or raw.dtype != np.dtype(_FLOAT_DTYPES[fmt]):
            raise TypeError(f"{fmt} data must be uint8 GGUF bytes, got {raw.dtype}")
        raw = raw.view(np.uint8)
    row_bytes = raw.shape[-1]
    if row_bytes % f.block_bytes:
        raise ValueError(f"{fmt} row of {row_bytes} bytes is not whole {f.block_bytes}-byte blocks")
    rows = raw.reshape(-1, row_bytes)
    num_rows, num_blocks = rows.shape[0], row_bytes // f.block_bytes
    cols = num_blocks * f.block_elems
    if num_cols is not None and num_cols != cols:
        raise ValueError(f"{fmt} rows of {row_bytes} bytes hold {cols} columns, not {num_cols}")
    if f.is_float:
        values = rows.view(_FLOAT_DTYPES[fmt])
        return PackedMatrix(fmt, num_rows, cols, values, np.zeros((1, 1), np.float16), np.zeros((1, 1), np.uint8))
    blocks = rows.reshape(num_rows, num_blocks, f.block_bytes)
    planes = {}
    for plane, dtype in _PLANE_DTYPES.items():
        parts = [blocks[:, :, start:end] for p, start, end in f.fields if p == plane]
        if not parts:
            planes[plane] = np.zeros((1, 1), dtype)
            continue
        plane_bytes = np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(num_rows, -1)
        planes[plane] = plane_bytes.view(np.dtype(dtype).newbyteorder("<")).astype(dtype, copy=False)
    return PackedMatrix(fmt, num_rows, cols, planes["quants"], planes["scales"], planes["extra"])


def unpack(p: PackedMatrix) -> np.ndarray:
    """The GGUF bytes [num_rows, row_bytes] of a packed matrix (host planes or device planes)."""
    f = quant_format(p.fmt)
    host = [a if isinstance(a, np.ndarray) else a.copy_to_host() for a in (p.quants, p.scales, p.extra)]
    if f.is_float:
        return np.ascontiguousarray(host[0]).view(np.uint8).reshape(p.num_rows, -1)
    num_blocks = p.num_cols // f.block_elems
    present = {plane for plane, _, _ in f.fields}
    planes = {
        name: arr.view(np.uint8).reshape(p.num_rows, num_blocks, -1)
        for name, arr in zip(_PLANE_DTYPES, host)
        if name in present
    }
    taken = dict.fromkeys(_PLANE_DTYPES, 0)
    out = np.empty((p.num_rows, num_blocks, f.block_bytes), np.uint8)
    for plane, start, end in f.fields:
        out[:, :, start:end] = planes[plane][:, :, taken[plane] : taken[plane] + end - start]
        taken[plane] += end - start
    return out.reshape(p.num_rows, -1)


def to_device(p: PackedMatrix) -> PackedMatrix:
    return p._replace(quants=cuda.to_device(p.quants), scales=cuda.to_device(p.scales), extra=cuda.to_device(p.extra))


def empty_packed(fmt: str, num_rows: int, num_cols: int, on_device: bool = True) -> PackedMatrix:
    """A zero-filled packed matrix (a KV cache layer, an expert slot) on the device or the host."""
    planes = {}
    for plane, dtype in _PLANE_DTYPES.items():
        shape, plane_dtype = plane_shapes(fmt, num_rows, num_cols).get(plane, ((1, 1), dtype))
        host = np.zeros(shape, plane_dtype)
        planes[plane] = cuda.to_device(host) if on_device else host
    return PackedMatrix(fmt, num_rows, num_cols, planes["quants"], planes["scales"], planes["extra"])


def check_packed(name: str, p, *, num_cols: int | None = None, formats=None) -> PackedMatrix:
    """Validate a PackedMatrix's planes against its format and shape; return it. A plane may be wider
    than its format needs (``shared_plane_shapes``): every kernel reads a row at the plane's own pitch."""
    if not isinstance(p, PackedMatrix):
        raise TypeError(f"{name} must be a PackedMatrix (see strata.gpu.kernels.packing.pack), got {type(p).__name__}")
    quant_format(p.fmt)
    if formats is not None and p.fmt not in formats:
        raise ValueError(f"{name} format {p.fmt} is not supported here; supported: {', '.join(formats)}")
    if num_cols is not None and p.num_cols != num_cols:
        raise ValueError(f"{name} has {p.num_cols} columns, expected {num_cols}")
    shapes = plane_shapes(p.fmt, p.num_rows, p.num_cols)
    for plane, dtype in _PLANE_DTYPES.items():
        shape, plane_dtype = shapes.get(plane, ((1, 1), dtype))
        array = getattr(p, plane)
        if plane in shapes and len(array.shape) == 2 and array.shape[0] == shape[0] and array.shape[1] > shape[1]:
            shape = (shape[0], array.shape[1])  # a wider pitch
        check_array(f"{name}.{plane}", array, dtypes=plane_dtype, shape=shape)
    return p

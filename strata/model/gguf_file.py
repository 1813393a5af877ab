"""Open a GGUF file memory-mapped, and check it against the model spec before anything uses it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as QType

from strata.errors import ModelFormatError, NonFiniteWeightError
from strata.model import quants
from strata.model.metadata import read_metadata
from strata.model.spec import ModelSpec, spec_from_metadata, tensor_shapes

GGUF_MAGIC = b"GGUF"
_MIN_HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, KV count
_PARSE_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError)
# Where a block holds floating-point numbers: (byte offset, bytes) of each field, and the exponent bits
# that are all ones exactly when the number is NaN or infinite. Every other field is a small integer
# that multiplies them, so a block decodes to finite values iff these fields are finite: checking them
# reads 2 of every 18 bytes of Q4_0 and dequantizes nothing.
_F16_INF, _BF16_INF, _F32_INF = 0x7C00, 0x7F80, 0x7F800000
_FLOAT_FIELDS = {
    QType.F32: ((0, 4),), QType.F16: ((0, 2),), QType.BF16: ((0, 2),),
    QType.Q8_0: ((0, 2),), QType.Q4_0: ((0, 2),), QType.Q5_0: ((0, 2),), QType.Q4_1: ((0, 2), (2, 2)),
    QType.Q5_1: ((0, 2), (2, 2)), QType.Q4_K: ((0, 2), (2, 2)), QType.Q5_K: ((0, 2), (2, 2)),
    QType.Q6_K: ((208, 2),), QType.IQ4_NL: ((0, 2),), QType.IQ4_XS: ((0, 2),), QType.IQ3_XXS: ((0, 2),),
    QType.IQ3_S: ((0, 2),), QType.IQ2_S: ((0, 2),),
}
_CHECK_BLOCKS = 1 << 22  # blocks checked at a time: bounds the temporaries to a few MiB


@dataclass(frozen=True)
class TensorRef:
    """One tensor of the file. `shape` is NumPy row-major (reverse of ggml `ne`); `data` is a
    read-only uint8 memmap view of its bytes, shaped [*shape[:-1], bytes per row]."""

    name: str
    qtype: QType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class GgufModel:
    path: Path
    metadata: dict[str, Any]
    spec: ModelSpec
    tensors: dict[str, TensorRef]
    data_offset_bytes: int = 0  # where tensor data begins: header, metadata and tensor table lie before it

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its NumPy shape."""
        if name not in self.tensors:
            raise ModelFormatError(f"{self.path}: no tensor {name!r}")
        ref = self.tensors[name]
        return quants.dequantize(ref.data, ref.qtype, ref.shape)


def layer_of(name: str) -> int | None:
    """The layer a tensor belongs to (``blk.<layer>.``), None for the embedding, the head and the other globals."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else None


def first_nonfinite_block(ref: TensorRef) -> int | None:
    """The index of the first block of ``ref`` (blocks numbered in file order) holding NaN or
    infinity, or None. Reads only the blocks' float fields (``_FLOAT_FIELDS``)."""
    block_bytes = GGML_QUANT_SIZES[ref.qtype][1]
    blocks = ref.data.reshape(-1, block_bytes)  # [num_blocks, block_bytes]
    exponent = _BF16_INF if ref.qtype == QType.BF16 else _F16_INF
    for first in range(0, blocks.shape[0], _CHECK_BLOCKS):
        part = blocks[first:first + _CHECK_BLOCKS]
        if ref.qtype not in _FLOAT_FIELDS:  # a format without its fields listed: decoded, a batch at a time
            with np.errstate(invalid="ignore", over="ignore"):
                values = quants.dequantize(part, ref.qtype, (len(part), GGML_QUANT_SIZES[ref.qtype][0]))
            bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
            if len(bad):
                return first + int(bad[0])
            continue
        for offset, width in _FLOAT_FIELDS[ref.qtype]:
            bits = part[:, offset:offset + width].view(np.uint32 if width == 4 else np.uint16)[:, 0]
            mask = _F32_INF if width == 4 else exponent
            bad = np.flatnonzero((bits & mask) == mask)
            if len(bad):
                return first + int(bad[0])
    return None


def check_finite(ref: TensorRef, source: str | os.PathLike[str]) -> None:
    """Raise ``NonFiniteWeightError`` naming the tensor and the row if any of its weights is NaN or
    infinite (a model whose weights are not finite would compute NaN logits for every token)."""
    block = first_nonfinite_block(ref)
    if block is None:
        return
    blocks_per_row = ref.data.shape[-1] // GGML_QUANT_SIZES[ref.qtype][1]
    row, column_block = divmod(block, blocks_per_row)
    raise NonFiniteWeightError(
        f"{source}: tensor {ref.name} ({ref.qtype.name}) holds NaN or infinity (row {row}, block {column_block} "
        f"of the row): the file is corrupt; convert or download the model again", ref.name)


def open_gguf(path: str | os.PathLike[str]) -> GgufModel:
    """Map the file, read metadata and tensor table, build the spec, validate every tensor."""
    path = Path(path)
    reader = open_reader(path)
    tensors = {t.name: _tensor_ref(reader, t) for t in reader.tensors}
    metadata = read_metadata(reader)
    spec = spec_from_metadata(metadata, tensors.keys(), source=str(path))
    _check_tensors(path, spec, tensors)
    return GgufModel(path=path, metadata=metadata, spec=spec, tensors=tensors,
                     data_offset_bytes=int(reader.data_offset))


def open_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """A checked, memory-mapped `GGUFReader` (for metadata-only users such as the tokenizer)."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    file_nbytes = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(f"{path}: wrong magic {magic!r}, expected {GGUF_MAGIC!r} (not a GGUF file)")
    if file_nbytes < _MIN_HEADER_BYTES:
        raise ModelFormatError(f"{path}: truncated: {file_nbytes} bytes, a GGUF header needs {_MIN_HEADER_BYTES}")
    try:
        return _CheckedReader(path)
    except _PARSE_ERRORS as exc:
        raise ModelFormatError(
            f"{path}: cannot parse the GGUF header and tensor table ({type(exc).__name__}: {exc}); "
            f"the file ({file_nbytes} bytes) is truncated or corrupt"
        ) from exc


class _CheckedReader(GGUFReader):
    """GGUFReader that checks each tensor's type and byte range before mapping it, and parses
    ~3x faster: its many small reads slice a plain ndarray view of the map (np.memmap's own
    slicing costs ~1.5 us per call, and a 150k-token vocabulary makes ~500k of them)."""

    def __init__(self, path: Path):
        self._source = str(path)
        super().__init__(path, "r")

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None or plain.base is not self.data:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        dtype = np.dtype(dtype)
        arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        file_nbytes = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            qtype = _qtype_of(self._source, name, int(raw_type[0]))
            block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
            num_cols = int(dims[0]) if len(dims) else 1
            if num_cols % block_elems:
                raise ModelFormatError(
                    f"{self._source}: tensor {name}: {qtype.name} rows need a multiple of {block_elems} "
                    f"columns, got {num_cols}"
                )
            nbytes = int(np.prod(dims.astype(object))) // block_elems * block_bytes
            end = start_offs + int(offset[0]) + nbytes
            if end > file_nbytes:
                raise ModelFormatError(
                    f"{self._source}: truncated: tensor {name} needs bytes up to offset {end}, "
                    f"but the file has {file_nbytes} bytes"
                )
        super()._build_tensors(start_offs, fields)


def _qtype_of(source: str, name: str, raw_type: int) -> QType:
    if not quants.is_supported(raw_type):
        try:
            type_name = QType(raw_type).name
        except ValueError:
            type_name = f"unknown type id {raw_type}"
        raise ModelFormatError(
            f"{source}: tensor {name} has quant type {type_name}; supported: {quants.supported_names()}"
        )
    return QType(raw_type)


def _tensor_ref(reader: GGUFReader, tensor) -> TensorRef:
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    row_bytes = quants.row_nbytes(tensor.tensor_type, shape[-1])
    data = reader.data[tensor.data_offset : tensor.data_offset + tensor.n_bytes]
    return TensorRef(tensor.name, QType(tensor.tensor_type), shape, data.reshape(*shape[:-1], row_bytes))


def _check_tensors(path: Path, spec: ModelSpec, tensors: dict[str, TensorRef]) -> None:
    required, optional = tensor_shapes(spec)
    missing = [name for name in required if name not in tensors]
    if missing:
        listed = ", ".join(f"{n} {list(required[n])}" for n in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ModelFormatError(f"{path}: missing tensor {listed}{more} (expected for {spec.arch})")
    unexpected = [name for name in tensors if name not in required and name not in optional]
    if unexpected:
        raise ModelFormatError(
            f"{path}: unexpected tensor {', '.join(unexpected[:4])} for {spec.arch} with "
            f"{spec.num_layers} layers and {spec.num_nextn_layers} nextn layers"
        )
    expected = {**optional, **required}
    for name, ref in tensors.items():
        if ref.shape != expected[name]:
            raise ModelFormatError(
                f"{path}: tensor {name} has shape {list(ref.shape)}, expected {list(expected[name])}"
            )

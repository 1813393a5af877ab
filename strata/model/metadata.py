"""GGUF key/value metadata as plain Python values.

`gguf.GGUFReader` keeps each array element as its own tiny NumPy view; turning a 150k-entry
token-type or score array into Python values element by element costs ~0.1 s per array. Numeric
arrays are stored contiguously in the file, so they are read here in one `frombuffer` call.
String arrays need one decode per string, which is unavoidable.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

_HEADER_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")
_ARRAY_HEADER_BYTES = 4 + 8  # element type (u32) + element count (u64)
_KEY_HEADER_BYTES = 8 + 4  # key length (u64) ... key bytes ... + value type (u32)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every KV pair of the file (header pseudo-keys excluded), in file order."""
    return {name: field_value(reader, field) for name, field in reader.fields.items() if name not in _HEADER_KEYS}


def field_value(reader: GGUFReader, field: ReaderField) -> Any:
    """One field as str, int, float, bool, or a list of those."""
    main_type = field.types[0]
    if main_type == GGUFValueType.STRING:
        return _decode(field.parts[-1])
    if main_type != GGUFValueType.ARRAY:
        return _scalar(field.parts[-1][0], main_type)
    if len(field.types) != 2:  # nested arrays: rare; fall back to the reader's own walk
        return field.contents()
    elem_type = field.types[1]
    if elem_type == GGUFValueType.STRING:
        return [_decode(field.parts[i]) for i in field.data]
    return _numeric_array(reader, field, elem_type).tolist()


def _numeric_array(reader: GGUFReader, field: ReaderField, elem_type: GGUFValueType) -> np.ndarray:
    key_len = int(field.parts[0][0])
    start = field.offset + _KEY_HEADER_BYTES + key_len + _ARRAY_HEADER_BYTES
    count = int(field.parts[4][0])
    dtype = np.dtype(reader.gguf_scalar_to_np[elem_type]).newbyteorder(reader.byte_order)
    return np.frombuffer(reader.data, dtype=dtype, count=count, offset=start)


def _scalar(value: np.generic, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.BOOL:
        return bool(value)
    if value_type in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(value)
    return int(value)


def _decode(raw: np.ndarray) -> str:
    # surrogateescape keeps the exact bytes of a token that is not valid UTF-8 on its own
    return raw.tobytes().decode("utf-8", errors="surrogateescape")

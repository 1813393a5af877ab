"""Model files with NaN or infinity written into one tensor, as a corrupted download would have them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as QType

F16_NAN = np.array([np.nan], np.float16).view(np.uint8)
# the byte offset, inside a block, of a float field (the scale) of every format the tests corrupt
SCALE_OFFSET = {QType.F32: 0, QType.F16: 0, QType.BF16: 0, QType.Q8_0: 0, QType.Q4_0: 0, QType.Q4_1: 2,
                QType.Q5_0: 0, QType.Q5_1: 2, QType.Q4_K: 2, QType.Q5_K: 0, QType.Q6_K: 208, QType.IQ4_NL: 0,
                QType.IQ4_XS: 0, QType.IQ3_XXS: 0, QType.IQ3_S: 0, QType.IQ2_S: 0}


def corrupt_block(data: np.ndarray, qtype: QType, block: int, value: float = np.nan) -> None:
    """Write ``value`` into the float field of block ``block`` of a tensor's raw bytes (in place)."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    start = block * block_bytes + SCALE_OFFSET[qtype]
    flat = data.reshape(-1)
    if qtype == QType.F32:
        flat[start:start + 4] = np.array([value], np.float32).view(np.uint8)
    elif qtype == QType.BF16:
        flat[start:start + 2] = np.array([value], np.float32).view(np.uint8)[2:4]
    else:
        flat[start:start + 2] = np.array([value], np.float16).view(np.uint8)


def corrupt_copy(source: Path, target: Path, tensor_name: str, block: int, value: float = np.nan) -> Path:
    """A copy of the GGUF ``source`` at ``target`` whose tensor ``tensor_name`` holds ``value`` in ``block``."""
    shutil.copyfile(source, target)
    reader = GGUFReader(target, "r+")
    tensor = next(t for t in reader.tensors if t.name == tensor_name)
    data = reader.data[tensor.data_offset:tensor.data_offset + tensor.n_bytes]
    corrupt_block(data, QType(tensor.tensor_type), block, value)
    reader.data.flush()
    del reader
    return target

"""The tensor types llama.cpp's quantizer picks under its presets, for the synthetic models to copy.

A preset (llama-quantize's file type, e.g. Q4_K_M) is a default type plus per-tensor rules: the
output head gets more bits, some attention and FFN-down tensors get more bits on some layers, and a
tensor whose rows are not whole blocks of the chosen type falls back to a 32-element type. These
are the rules of `llama_tensor_get_type` in llama.cpp's src/llama-quant.cpp for every tensor
a qwen3moe or llama model has (not Falcon's, not the 70B llama's attn_v bump), written for the
presets below. IQ3_XXS is mixed as llama.cpp mixes it with an importance matrix, which it requires
(its attn_q and attn_k become IQ2_S, which llama.cpp refuses to write without one); the others
as without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType

from strata.model import quants

# preset -> (its default type, general.file_type)
PRESETS: dict[str, tuple[QType, LlamaFileType]] = {
    "Q4_0": (QType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_K_M": (QType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": (QType.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "Q6_K": (QType.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "IQ4_XS": (QType.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
    "IQ3_XXS": (QType.IQ3_XXS, LlamaFileType.MOSTLY_IQ3_XXS),
}
_WITH_IMATRIX = ("IQ3_XXS",)
# a type whose block does not divide the row -> the type llama.cpp writes instead (then F16)
_FALLBACKS = {QType.IQ3_XXS: QType.IQ4_NL, QType.IQ3_S: QType.IQ4_NL, QType.IQ2_S: QType.IQ4_NL,
              QType.IQ4_XS: QType.IQ4_NL, QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}


@dataclass(frozen=True)
class MixModel:
    """What the rules read of the model: hparams and which tensors the file has."""

    num_layers: int  # block_count, MTP blocks included
    num_experts: int
    num_heads: int
    num_kv_heads: int
    has_output: bool


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama.cpp quantizes the tensor at all (else it stays as converted: F32 here)."""
    is_matrix = int(np.prod(shape[:-1], dtype=np.int64)) > 1  # ggml_n_dims >= 2
    return (is_matrix and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def preset_types(preset: str, shapes: dict[str, tuple[int, ...]], model: MixModel) -> dict[str, QType]:
    """The type of every tensor of ``shapes`` (in file order) under ``preset``."""
    default_type = PRESETS[preset][0]
    num_attn_v = sum("attn_v.weight" in name for name in shapes)
    counters = {"attn_v": 0}
    types = {}
    for name, shape in shapes.items():
        if not is_quantized(name, shape):
            types[name] = QType.F32
            continue
        chosen = _rule(preset, default_type, name, shape, model, counters, num_attn_v)
        types[name] = _fitting(chosen, name, shape[-1])
    return types


def _rule(preset: str, default_type: QType, name: str, shape: tuple[int, ...], model: MixModel, counters: dict,
          num_attn_v: int) -> QType:
    num_cols = shape[-1]
    has_imatrix = preset in _WITH_IMATRIX
    is_8_experts = model.num_experts == 8
    if name == "output.weight" or (not model.has_output and name == "token_embd.weight"):
        if num_cols % quants.block_layout(default_type)[0]:
            return QType.Q8_0
        if preset == "IQ3_XXS":
            return QType.Q5_K
        return QType.Q6_K if default_type != QType.Q8_0 else default_type
    if name == "token_embd.weight":
        return QType.IQ3_S if preset == "IQ3_XXS" else default_type
    if "attn_v.weight" in name:
        layer = counters["attn_v"]
        counters["attn_v"] += 1
        if is_8_experts:
            return QType.Q8_0
        is_gqa4 = model.num_heads // model.num_kv_heads >= 4
        if preset == "IQ3_XXS":
            return QType.Q4_K if is_gqa4 else QType.IQ3_XXS if has_imatrix else QType.IQ3_S
        if preset == "IQ4_XS" and is_gqa4:
            return QType.Q5_K
        if preset in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, num_attn_v):
            return QType.Q6_K
        return default_type
    if "attn_k.weight" in name:
        return QType.Q8_0 if is_8_experts else QType.IQ2_S if preset == "IQ3_XXS" else default_type
    if "attn_q.weight" in name:
        return QType.IQ2_S if preset == "IQ3_XXS" else default_type
    if "ffn_down" in name:
        layer, num_layers = _layer(name), model.num_layers
        if preset in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, num_layers):
            return QType.Q6_K
        if preset == "IQ4_XS" and layer < num_layers // 8 and not has_imatrix:
            return QType.Q5_K
        return default_type
    if "attn_output.weight" in name:
        if is_8_experts:
            return QType.Q5_K if preset in ("IQ3_XXS", "IQ4_XS", "Q4_K_M") else default_type
        return QType.IQ3_S if preset == "IQ3_XXS" else default_type
    return default_type


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def _fitting(qtype: QType, name: str, num_cols: int) -> QType:
    if num_cols % quants.block_layout(qtype)[0] == 0:
        return qtype
    if qtype not in _FALLBACKS:
        raise ValueError(f"tensor {name}: rows of {num_cols} values are not whole {qtype.name} blocks, and "
                         f"llama.cpp has no fallback for {qtype.name}; choose sizes that are multiples of "
                         f"{quants.block_layout(qtype)[0]}")
    fallback = _FALLBACKS[qtype]
    return fallback if num_cols % quants.block_layout(fallback)[0] == 0 else QType.F16


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else 0

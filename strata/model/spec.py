"""The model spec: architecture hyper-parameters read from GGUF metadata, and the tensors they imply.

Metadata keys and tensor names follow llama.cpp (`gguf-py/gguf/constants.py`,
`src/llama-model.cpp`), so a GGUF from llama.cpp's converter loads unchanged. Shapes are in NumPy
row-major order, the reverse of ggml's `ne`.

Multi-token prediction follows llama.cpp's `nextn` convention: `{arch}.block_count` counts the
main layers plus `{arch}.nextn_predict_layers` extra decoder blocks placed after them; each extra
block `blk.{i}` holds a full decoder layer plus `nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm` and,
optionally, its own `nextn.embed_tokens`, `nextn.shared_head_norm` and `nextn.shared_head_head`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from strata.errors import ModelFormatError

SUPPORTED_ARCHS = ("qwen3moe", "qwen3", "llama")
Shape = tuple[int, ...]


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a decoder-only model.

    qwen3moe routes with a softmax over all experts, keeps the top `num_experts_used` and
    renormalises their weights to sum to 1 (llama.cpp's `build_moe_ffn(..., norm_w=true, softmax)`);
    RoPE uses NeoX ordering (rotate halves). qwen3 is its dense sibling (q/k norm, NeoX RoPE, SwiGLU
    `feed_forward_length` wide). llama has normal (interleaved-pair) RoPE and no q/k norm;
    it is dense, or, with `llama.expert_count` > 0 (Mixtral), routed as qwen3moe is, each expert
    `llama.feed_forward_length` wide (llama.cpp's `n_ff`), without shared experts.
    """

    arch: str
    num_layers: int  # main decoder layers, MTP blocks excluded
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_rope_dims: int
    vocab_size: int
    context_length: int  # tokens the model was trained for
    rope_theta: float
    is_rope_neox: bool
    rms_norm_eps: float
    dense_ffn_size: int  # 0 for MoE layers
    num_experts: int  # 0 for dense
    num_experts_used: int
    expert_ffn_size: int
    shared_expert_ffn_size: int  # 0 if there is no shared expert
    has_shared_expert_gate: bool  # sigmoid gate `ffn_gate_inp_shexp` scales the shared expert
    is_expert_weights_normalized: bool
    has_qk_norm: bool
    is_output_tied: bool  # no `output.weight`: logits use `token_embd.weight`
    num_nextn_layers: int

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def spec_from_metadata(metadata: Mapping[str, Any], tensor_names: Collection[str], source: str) -> ModelSpec:
    """Build and check the spec; `source` (the file) is named in every error."""
    arch = _get(metadata, "general.architecture", str, source)
    if arch not in SUPPORTED_ARCHS:
        raise ModelFormatError(
            f"{source}: key general.architecture is {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    def key(name: str, kind: type, default: Any = None) -> Any:
        return _get(metadata, f"{arch}.{name}", kind, source, default)

    num_heads = key("attention.head_count", int)
    hidden_size = key("embedding_length", int)
    head_dim = key("attention.key_length", int, hidden_size // max(num_heads, 1))
    value_dim = key("attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise ModelFormatError(f"{source}: key {arch}.attention.value_length is {value_dim}, expected {head_dim}")
    num_nextn = key("nextn_predict_layers", int, 0)
    num_blocks = key("block_count", int)
    if not 0 <= num_nextn < num_blocks:
        raise ModelFormatError(
            f"{source}: key {arch}.nextn_predict_layers is {num_nextn}, expected 0..{num_blocks - 1} "
            f"({arch}.block_count is {num_blocks})"
        )
    is_qwen3moe, is_qwen3 = arch == "qwen3moe", arch in ("qwen3moe", "qwen3")
    num_experts = key("expert_count", int, 0)
    if is_qwen3moe and num_experts <= 0:
        raise ModelFormatError(f"{source}: key {arch}.expert_count is {num_experts}, expected > 0")
    if arch == "qwen3" and num_experts:
        raise ModelFormatError(f"{source}: key {arch}.expert_count is {num_experts}, expected absent or 0 (a Qwen3 "
                               "model with experts is a qwen3moe file)")
    is_moe = num_experts > 0
    if is_moe and not is_qwen3moe and "blk.0.ffn_gate.0.weight" in tensor_names:
        raise ModelFormatError(
            f"{source}: the experts are stored one tensor per expert (blk.0.ffn_gate.0.weight, an early Mixtral "
            "conversion), which llama.cpp no longer reads either; convert the model again with a current "
            "llama.cpp convert_hf_to_gguf.py (it writes ffn_gate_exps, ffn_up_exps and ffn_down_exps stacked)"
        )
    spec = ModelSpec(
        arch=arch,
        num_layers=num_blocks - num_nextn,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv", int, num_heads),
        head_dim=head_dim,
        num_rope_dims=key("rope.dimension_count", int, head_dim),
        vocab_size=_vocab_size(metadata, arch, source),
        context_length=key("context_length", int),
        rope_theta=key("rope.freq_base", float, 10000.0),
        is_rope_neox=is_qwen3,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", float),
        dense_ffn_size=0 if is_moe else key("feed_forward_length", int),
        num_experts=num_experts,
        num_experts_used=key("expert_used_count", int) if is_moe else 0,
        expert_ffn_size=(key("expert_feed_forward_length", int) if is_qwen3moe
                         else key("feed_forward_length", int) if is_moe else 0),
        shared_expert_ffn_size=key("expert_shared_feed_forward_length", int, 0) if is_qwen3moe else 0,
        has_shared_expert_gate=is_qwen3moe and "blk.0.ffn_gate_inp_shexp.weight" in tensor_names,
        is_expert_weights_normalized=is_moe,
        has_qk_norm=is_qwen3,
        is_output_tied="output.weight" not in tensor_names,
        num_nextn_layers=num_nextn,
    )
    _check_consistent(spec, source)
    return spec


def tensor_shapes(spec: ModelSpec) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """(required, optional) tensor names of a model of this spec, each with its NumPy shape."""
    V, H = spec.vocab_size, spec.hidden_size
    required: dict[str, Shape] = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
    optional: dict[str, Shape] = {"output.weight": (V, H)}
    if spec.arch == "llama":
        optional["rope_freqs.weight"] = (spec.num_rope_dims // 2,)
    for i in range(spec.num_layers + spec.num_nextn_layers):
        block_required, block_optional = _block_shapes(spec)
        required.update({f"blk.{i}.{n}": s for n, s in block_required.items()})
        optional.update({f"blk.{i}.{n}": s for n, s in block_optional.items()})
    for i in range(spec.num_layers, spec.num_layers + spec.num_nextn_layers):
        required.update({f"blk.{i}.nextn.eh_proj.weight": (H, 2 * H)})
        required.update({f"blk.{i}.nextn.{n}.weight": (H,) for n in ("enorm", "hnorm")})
        optional.update({f"blk.{i}.nextn.{n}.weight": (V, H) for n in ("embed_tokens", "shared_head_head")})
        optional.update({f"blk.{i}.nextn.shared_head_norm.weight": (H,)})
    return required, optional


def _block_shapes(spec: ModelSpec) -> tuple[dict[str, Shape], dict[str, Shape]]:
    H, D = spec.hidden_size, spec.head_dim
    required: dict[str, Shape] = {
        "attn_norm.weight": (H,),
        "attn_q.weight": (spec.q_size, H),
        "attn_k.weight": (spec.kv_size, H),
        "attn_v.weight": (spec.kv_size, H),
        "attn_output.weight": (H, spec.q_size),
        "ffn_norm.weight": (H,),
    }
    optional: dict[str, Shape] = {}
    if spec.has_qk_norm:
        required.update({"attn_q_norm.weight": (D,), "attn_k_norm.weight": (D,)})
    if not spec.is_moe:
        F = spec.dense_ffn_size
        required.update({"ffn_gate.weight": (F, H), "ffn_up.weight": (F, H), "ffn_down.weight": (H, F)})
        return required, optional
    E, Fe = spec.num_experts, spec.expert_ffn_size
    required.update({"ffn_gate_inp.weight": (E, H), "ffn_gate_exps.weight": (E, Fe, H)})
    required.update({"ffn_up_exps.weight": (E, Fe, H), "ffn_down_exps.weight": (E, H, Fe)})
    if spec.shared_expert_ffn_size:
        Fs = spec.shared_expert_ffn_size
        required.update({"ffn_gate_shexp.weight": (Fs, H), "ffn_up_shexp.weight": (Fs, H)})
        required.update({"ffn_down_shexp.weight": (H, Fs)})
        (required if spec.has_shared_expert_gate else optional)["ffn_gate_inp_shexp.weight"] = (H,)
    return required, optional


def _vocab_size(metadata: Mapping[str, Any], arch: str, source: str) -> int:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        return len(tokens)
    return _get(metadata, f"{arch}.vocab_size", int, source)


def _check_consistent(spec: ModelSpec, source: str) -> None:
    checks = [  # (holds, key, value, expected)
        (spec.num_heads > 0, "attention.head_count", spec.num_heads, "> 0"),
        (spec.num_kv_heads > 0 and spec.num_heads % spec.num_kv_heads == 0, "attention.head_count_kv",
         spec.num_kv_heads, f"a divisor of attention.head_count ({spec.num_heads})"),
        (0 < spec.num_rope_dims <= spec.head_dim and spec.num_rope_dims % 2 == 0, "rope.dimension_count",
         spec.num_rope_dims, f"even and at most the head size ({spec.head_dim})"),
        (not spec.is_moe or 0 < spec.num_experts_used <= spec.num_experts, "expert_used_count",
         spec.num_experts_used, f"1..expert_count ({spec.num_experts})"),
        (not spec.is_moe or spec.expert_ffn_size > 0,
         "expert_feed_forward_length" if spec.arch == "qwen3moe" else "feed_forward_length", spec.expert_ffn_size,
         "> 0"),
        (spec.is_moe or spec.dense_ffn_size > 0, "feed_forward_length", spec.dense_ffn_size, "> 0"),
        (spec.rms_norm_eps > 0, "attention.layer_norm_rms_epsilon", spec.rms_norm_eps, "> 0"),
    ]
    for holds, name, value, expected in checks:
        if not holds:
            raise ModelFormatError(f"{source}: key {spec.arch}.{name} is {value}, expected {expected}")


def _get(metadata: Mapping[str, Any], name: str, kind: type, source: str, default: Any = None) -> Any:
    if name not in metadata:
        if default is None:
            raise ModelFormatError(f"{source}: required metadata key {name} is missing")
        return default
    value = metadata[name]
    is_ok = isinstance(value, kind) and not isinstance(value, bool) if kind is not float else (
        isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    if not is_ok:
        raise ModelFormatError(f"{source}: metadata key {name} is {value!r}, expected a {kind.__name__}")
    return kind(value)

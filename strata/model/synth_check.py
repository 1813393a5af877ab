"""Is routing spread? Per-layer expert counts of a prompt, through the reference forward.

A model whose router sends every token to the same few experts makes every offload benchmark
look several times too fast, so `strata synth --check` prints this histogram and fails when a
layer collapses. Layers run one at a time with a fresh reference model each, so only one layer's
dequantized weights are alive at once (a 30B-A3B layer is ~2.5 GB as float32).
"""

from __future__ import annotations

import numpy as np

from strata.model import quants
from strata.model.gguf_file import GgufModel
from strata.model.reference import KVCache, ReferenceModel, route

MAX_BUSIEST_RATIO = 6.0  # busiest expert's count over the uniform count, per layer (collapse: experts / top-k)
MIN_HIT_FRACTION = 0.5  # distinct experts hit over min(num_experts, picks), per layer


def routing_histogram(model: GgufModel, prompt_tokens) -> np.ndarray:
    """How often each expert is picked by the prompt's tokens in each main layer. -> [L, N] int64."""
    spec = model.spec
    if not spec.is_moe:
        raise ValueError(f"{model.path} is a dense {spec.arch} model: it has no routing")
    tokens = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)  # [T]
    counts = np.zeros((spec.num_layers, spec.num_experts), dtype=np.int64)  # [L, N]
    kv = KVCache.for_spec(spec, context_length=len(tokens))
    x = _embedding_rows(model, tokens)  # [T, D]
    for layer in range(spec.num_layers):
        x = _RoutingRecorder(model, counts).decoder_layer(layer, x, 0, kv)
    return counts


def is_spread(counts: np.ndarray, num_experts_used: int) -> bool:
    """True when no layer collapses onto a few experts (thresholds above)."""
    return all(_layer_verdict(row, num_experts_used)[0] for row in counts)


def format_histogram(counts: np.ndarray, num_experts_used: int) -> str:
    num_layers, num_experts = counts.shape
    num_tokens = int(counts[0].sum()) // num_experts_used if num_layers else 0
    lines = [f"routing of {num_tokens} tokens, top-{num_experts_used} of {num_experts} experts:"]
    for layer, row in enumerate(counts):
        is_ok, hit, ratio = _layer_verdict(row, num_experts_used)
        shown = " ".join(str(c) for c in row) if num_experts <= 16 else f"counts {row.min()}..{row.max()}"
        lines.append(f"  layer {layer:3d}: {hit:4d}/{num_experts} experts hit, busiest {ratio:4.1f}x uniform"
                     f"  {'ok' if is_ok else 'COLLAPSED'}  [{shown}]")
    verdict = "spread" if is_spread(counts, num_experts_used) else "NOT spread"
    lines.append(f"routing is {verdict} (a layer fails if it hits fewer than {MIN_HIT_FRACTION:.0%} of the "
                 f"experts it could or its busiest expert exceeds {MAX_BUSIEST_RATIO:.0f}x the uniform count)")
    return "\n".join(lines)


def _layer_verdict(row: np.ndarray, num_experts_used: int) -> tuple[bool, int, float]:
    num_picks = int(row.sum())
    hit = int(np.count_nonzero(row))
    uniform = num_picks / len(row)
    ratio = float(row.max()) / uniform if uniform else 0.0
    is_ok = hit >= MIN_HIT_FRACTION * min(len(row), num_picks) and ratio <= MAX_BUSIEST_RATIO
    return is_ok, hit, ratio


def _embedding_rows(model: GgufModel, tokens: np.ndarray) -> np.ndarray:
    ref = model.tensors["token_embd.weight"]
    return quants.dequantize(np.ascontiguousarray(ref.data[tokens]), ref.qtype, (len(tokens), ref.shape[1]))


class _RoutingRecorder(ReferenceModel):
    """The reference model, counting each layer's top-k choices before running the experts."""

    def __init__(self, model: GgufModel, counts: np.ndarray):
        def get_weight(name: str) -> np.ndarray:
            if name not in model.tensors:
                raise KeyError(name)
            return model.dequantize(name)

        super().__init__(model.spec, get_weight)
        self._counts = counts

    def ffn_block(self, layer: int, h: np.ndarray) -> np.ndarray:
        router = self.weight(f"blk.{layer}.ffn_gate_inp.weight").astype(np.float64)  # [N, D]
        ids, _ = route(h.astype(np.float64) @ router.T, self.spec.num_experts_used,
                       self.spec.is_expert_weights_normalized)  # [T, k]
        self._counts[layer] += np.bincount(ids.reshape(-1), minlength=self.spec.num_experts)
        return super().ffn_block(layer, h)

"""Decode with its cache misses read in place (``runtime.decode_misses = "host"``): every layer's table of
its experts' plane addresses, the cache slot of a cached expert and the pinned expert pack for the rest
(``PlaneArena.address_table``), which the expert kernels read by routed expert id (``Ops.moe_addressed``).

Nothing is staged during decode: the cache stays as the prefill (or the loan's restore) left it, so the
tables, written at a request's first step, stay true to its end, and a token is one captured graph with
no host work between its layers: decode's pace is the GPU's and the PCIe link's, not the host's.
"""

from __future__ import annotations

import numpy as np

from strata.engine.decode.layers import DecodeLayers


def can_read_in_place(model: DecodeLayers) -> bool:
    """Whether the backend reads this model's routed experts by address: device addresses for the
    cache's slots (not the simulator's), an expert pack, and C++ rows for every layer's formats."""
    cache, ops, spec = model.cache, model.ops, model.spec
    if cache is None or model.pack is None or not hasattr(ops, "moe_addressed"):
        return False
    if not getattr(cache.storage, "has_device_addresses", False):
        return False
    return all(ops.can_address_experts(cache.storage, cache.layout.at_layer(layer), spec.num_experts_used)
               for layer in range(spec.num_layers))


def address_tables(model: DecodeLayers) -> np.ndarray:
    """[L, N, C] uint64: each layer's experts' plane addresses as the cache holds them now."""
    spec, cache = model.spec, model.cache
    slots = cache.slot_table(spec.num_layers, spec.num_experts)  # [L, N] slot or -1
    return np.stack([cache.storage.address_table(slots[layer], model.pack.slot_addresses(layer))
                     for layer in range(spec.num_layers)])

"""Routed experts whose type changes between layers (llama.cpp's Q4_K_M mix: some layers' ffn_down_exps
get more bits) in one expert arena: each layer's experts, packed in the model's slot geometry and staged
into slots next to another layer's, give the NumPy backend's MoE on the kernels."""

import numpy as np
import pytest
from numba import config as numba_config

from strata.backend.select import has_cuda_device, make_ops
from strata.engine.memory.expert_pack import ExpertPack
from strata.gpu.kernels.packing import PackedMatrix, check_packed, plane_shapes, unpack
from strata.gpu.ledger import VramLedger
from strata.model.gguf_file import open_gguf
from strata.model.synth import PRESETS, write_synthetic_model

BACKEND = "cuda" if has_cuda_device() else "cudasim"
pytestmark = pytest.mark.skipif(BACKEND == "cudasim" and not numba_config.ENABLE_CUDASIM,
                                reason="no GPU, and the CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1)")
PLANE_DTYPES = {"quants": np.uint32, "scales": np.float16, "extra": np.uint8}
_SLOT_OF_LAYER = ((5, 2, 7, 0, 3, 6, 1, 4), (4, 6, 1, 3, 0, 2, 7, 5))  # [layer][expert]: the layers interleave


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    path = write_synthetic_model(tmp_path_factory.mktemp("mix") / "q4_k_m.gguf", PRESETS["tiny"], "Q4_K_M", seed=1)
    model = open_gguf(path)
    kinds = [model.tensors[f"blk.{layer}.ffn_down_exps.weight"].qtype.name for layer in range(2)]
    assert kinds == ["Q5_0", "Q8_0"]  # the tiny rows' fallbacks of Q4_K and Q6_K, a more-bits layer
    return model


def _staged(ops, model):
    """An arena of 16 slots holding both layers' 8 experts (_SLOT_OF_LAYER), from the model's expert pack."""
    layout = ops.expert_layout(model)
    pack = ExpertPack.from_gguf(model, layout, lambda n: np.empty(n, np.uint8), ops.encode_experts)
    storage = ops.arena("expert_cache", 16 * layout.slot_bytes, 16 * layout.slot_bytes, layout)
    storage.map_segments(storage.segment_bytes)
    for layer, slots in enumerate(_SLOT_OF_LAYER):
        ticket = ops.stage_experts(storage, [s + 8 * layer for s in slots], [pack.slot(layer, e) for e in range(8)])
        ops.wait_staged(ticket)
    return layout, storage


def test_each_layers_experts_read_back_as_their_gguf_bytes_from_planes_of_the_widest_type(mixed_model):
    ops = make_ops(BACKEND, VramLedger(1 << 30))
    layout, storage = _staged(ops, mixed_model)
    assert layout.is_mixed and layout.at_layer(1).qtypes[2].name == "Q8_0"
    for layer, slots in enumerate(_SLOT_OF_LAYER):
        down = check_packed("down", storage.matrices(layout.at_layer(layer))[2])  # planes wider than Q5_0's
        rows, cols = layout.shapes[2]
        own = plane_shapes(down.fmt, rows, cols)
        raw = mixed_model.tensors[f"blk.{layer}.ffn_down_exps.weight"].data  # [N, rows, row_bytes]
        for expert, slot in enumerate(slots):
            first = (slot + 8 * layer) * rows
            planes = {name: ops.to_host(getattr(down, name))[first:first + rows, :own[name][0][1]] if name in own
                      else np.zeros((1, 1), dtype) for name, dtype in PLANE_DTYPES.items()}
            expert_rows = PackedMatrix(down.fmt, rows, cols, **planes)
            assert np.array_equal(unpack(expert_rows), raw[expert])


# decode rows read both layers; the prefill kernels (slow in the simulator) layer 0's Q5_0 down, the type whose
# planes are narrower than their pitch
@pytest.mark.parametrize("num_tokens, layers", [(2, (0, 1)), (10, (0,))], ids=["decode-rows", "prefill"])
def test_moe_of_each_layer_equals_the_numpy_backends(mixed_model, num_tokens, layers):
    reference, kernels = make_ops("numpy", VramLedger(1 << 30)), make_ops(BACKEND, VramLedger(1 << 30))
    (ref_layout, ref_storage), (layout, storage) = _staged(reference, mixed_model), _staged(kernels, mixed_model)
    rng = np.random.default_rng(5)
    dim = mixed_model.spec.hidden_size
    for layer in layers:
        slots = _SLOT_OF_LAYER[layer]
        x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
        ids = np.stack([rng.permutation(8)[:2] for _ in range(num_tokens)]).astype(np.int32)  # [T, 2]
        weights = rng.uniform(0.2, 0.8, ids.shape).astype(np.float32)
        table = np.array([s + 8 * layer for s in slots], dtype=np.int32)  # [N] slot of each expert
        expected = np.zeros((num_tokens, dim))
        reference.moe(expected, x, ids, weights, ref_storage, table, ref_layout.at_layer(layer))
        out = kernels.upload("activations", np.zeros((num_tokens, dim), np.float32))
        at_layer = layout.at_layer(layer)
        groups = kernels.moe_groups(kernels.upload("activations", ids), kernels.upload("activations", weights), 8,
                                    at_layer)
        kernels.moe(out, kernels.upload("activations", x), kernels.upload("activations", ids),
                    kernels.upload("activations", weights), storage, table, at_layer, groups)
        got = kernels.to_host(out)
        # float16 activations on the kernels' prefill path: errors of ~1e-3 of the outputs' scale
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=0, atol=5e-3 * scale)

"""When decode reads its misses in place, and the tables it reads them through (expert_addresses)."""

import types

import numpy as np

from strata.engine.decode.expert_addresses import address_tables, can_read_in_place


class RecordingStorage:
    def __init__(self, has_device_addresses=True):
        self.has_device_addresses = has_device_addresses
        self.calls = []

    def address_table(self, slots, host_addresses):
        self.calls.append((slots.tolist(), host_addresses.tolist()))
        return np.stack([np.where(slots >= 0, slots, 1000 + host_addresses)] * 2, axis=1).astype(np.uint64)


class Layout:
    def __init__(self, refused_layers=()):
        self.refused_layers = refused_layers

    def at_layer(self, layer):
        return ("layout", layer)


def _model(*, pack=True, device_addresses=True, refused_layers=(), ops_reads=True):
    storage = RecordingStorage(device_addresses)
    slots = np.array([[0, -1, 2], [-1, -1, 5]], np.int32)  # [L, N]
    cache = types.SimpleNamespace(storage=storage, layout=Layout(refused_layers),
                                  slot_table=lambda num_layers, num_experts: slots)
    spec = types.SimpleNamespace(num_layers=2, num_experts=3, num_experts_used=2)
    ops = types.SimpleNamespace(can_address_experts=lambda s, layout, top_k: layout[1] not in refused_layers)
    if ops_reads:
        ops.moe_addressed = lambda *args: None
    pack_obj = types.SimpleNamespace(slot_addresses=lambda layer: np.arange(3, dtype=np.uint64) + 10 * layer)
    return types.SimpleNamespace(cache=cache, ops=ops, spec=spec, pack=pack_obj if pack else None)


def test_misses_are_read_in_place_only_where_every_part_is_there():
    assert can_read_in_place(_model())
    assert not can_read_in_place(_model(pack=False))  # nothing pinned to read from
    assert not can_read_in_place(_model(device_addresses=False))  # the simulator's host arrays
    assert not can_read_in_place(_model(ops_reads=False))  # a backend without the addressed kernels
    assert not can_read_in_place(_model(refused_layers=(1,)))  # one layer's formats lack the C++ rows


def test_each_layer_gets_its_slots_and_its_own_pack_addresses():
    model = _model()
    tables = address_tables(model)
    assert tables.shape == (2, 3, 2)
    assert model.cache.storage.calls == [([0, -1, 2], [0, 1, 2]), ([-1, -1, 5], [10, 11, 12])]
    assert tables[:, :, 0].tolist() == [[0, 1001, 2], [1010, 1011, 5]]

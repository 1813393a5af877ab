"""The cuda backend's routed experts (``CudaOps`` takes them from ``MoeOps``): routing, a prefill
layer's pairs grouped by expert once, the expert products over the arena's slots (decode rows, or
grouped prefill tiles), and the slot tables that turn expert ids into slots on the device."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
from numba import cuda  # a module global: the simulator swaps it inside kernels

from strata.backend.ops import DECODE_MAX_ROWS, ExpertLayout, QTensor
from strata.gpu.ledger import ACTIVATIONS_OWNER as ACTIVATIONS


@dataclasses.dataclass
class LayerGroups:
    """A prefill layer's routed pairs grouped by expert (``moe_groups``), and the layer's X staged once for
    all of its expert launches with their hidden scratch (``moe``). The next layer of the chunk takes its
    buffers (``moe_groups(previous=...)``); the last layer's go when the chunk's forward lets them go."""

    groups: object  # moe_route.MoeGroups
    scratch: dict = dataclasses.field(default_factory=dict)  # the grouping's buffers by role, lent to the next layer
    staged: object = None  # moe.StagedPrefill: this layer's, or the previous layer's until moe() stages again
    staged_from: object = None  # the X it was staged from

    @property
    def block_m(self) -> int:
        return self.groups.block_m


@dataclasses.dataclass
class FixedSums:
    """A prefill layer's MoE accumulator under ``runtime.deterministic``: the routed experts add into ``sums``
    (int64 fixed point, gpu/kernels/fixed_sums.py: the same bits in any order and batching), the shared expert
    into ``residual`` itself, and ``CudaOps.add(residual, this)`` adds the sums in once."""

    residual: object  # x [T, D] float32
    sums: object  # [T, D] int64, units of 2^-32


class MoeOps:
    """The MoE ops of ``CudaOps`` (its ``cuda``, ``_owning``, ``_stream``, ``matmul``, ``add``, the forced tile
    rows ``_forced_tile_rows`` and ``is_deterministic``)."""

    def route(self, x, router: QTensor, num_used: int, is_norm: bool):
        from strata.gpu.kernels.moe_route import moe_route

        logits = self.matmul(x, router)
        with self._owning(ACTIVATIONS):
            ids, weights = moe_route(logits, num_used, norm_weights=is_norm, stream=self._stream)
        return ids, weights  # [T, k] int32 on the device; to_host when the host must pick experts

    def decode_route(self, x, norm, eps: float, router: QTensor, num_used: int, is_norm: bool, counters,
                     slot_table=None):
        """A decode step's (h, ids, weights, slots): h = rms_norm(x) [R, D], the top-k ids and weights of h's
        router logits, and each id's slot in ``slot_table`` [N] (device; -1: none), or None without a table.
        One launch where the router is F32/F16 (``decode_route.py``, whose logits are its own sums, so a near
        tie may pick otherwise than ``route``; ``counters`` [>= R] int32 on the device, zero: its per-token
        counts, zero again after), else the norm, ``route`` and the map apart."""
        from strata.gpu.kernels import decode_route as fused

        if x.dtype == np.float32 and x.shape[0] <= DECODE_MAX_ROWS and fused.is_supported(router.data, x.shape[0],
                                                                                           num_used):
            with self._owning(ACTIVATIONS):
                return fused.decode_route(x, norm, eps, router.data, num_used, counters, norm_weights=is_norm,
                                          slot_table=slot_table, stream=self._stream)
        h = self.rms_norm(x, norm, eps)
        ids, weights = self.route(h, router, num_used, is_norm)
        if slot_table is None:
            return h, ids, weights, None
        with self._owning(ACTIVATIONS):
            return h, ids, weights, _map_ids(ids, slot_table, to_slots=True, stream=self._stream)

    def moe_accumulator(self, x, is_batched: bool = False):
        """x itself (the kernels add into the residual stream), or with ``is_deterministic`` a prefill chunk's
        ``FixedSums``: a chunk of many rows, or of few whose experts come in several launches (``is_batched``);
        decode's kernels add each row's experts in one order within a launch, which one launch a layer keeps."""
        if not self.is_deterministic or (x.shape[0] <= DECODE_MAX_ROWS and not is_batched):
            return x
        from strata.gpu.kernels.fixed_sums import fixed_sums

        with self._owning(ACTIVATIONS):
            return FixedSums(x, fixed_sums(tuple(x.shape), x))

    def moe_groups(self, ids, weights, num_experts: int, layout: ExpertLayout | None = None, previous=None):
        """A prefill chunk's routed pairs grouped by expert id once per layer: every ring batch of the
        layer then launches only its two expert products (tiles of experts it has not staged exit). The
        previous layer's groups lend their buffers (its launches are queued before these, on one stream)."""
        from strata.gpu.kernels.moe_route import moe_group

        if ids.shape[0] <= DECODE_MAX_ROWS:
            return None
        ids = ids if not isinstance(ids, np.ndarray) else self.cuda.to_device(np.asarray(ids, dtype=np.int32))
        with self._owning(ACTIVATIONS):  # the tiles' rows follow the chunk's rows an expert (moe() takes the groups')
            if not isinstance(self._stream, int):
                previous = None  # a graph is being captured: its nodes keep their own buffers
            scratch, staged = ({}, None) if previous is None else (previous.scratch, previous.staged)
            if previous is not None:  # the new groups hold its buffers alone, and its input goes now
                previous.staged = previous.staged_from = previous.groups = None
            groups = moe_group(ids, weights, num_experts,
                               self._moe_block_m(ids.shape[0] * ids.shape[1], num_experts, layout), scratch=scratch)
            return LayerGroups(groups, scratch=scratch, staged=staged)  # staged from another X: staged again

    def moe_tile_rows(self, layout: ExpertLayout | None = None) -> tuple:
        from strata.gpu.kernels import tensor_core
        from strata.gpu.kernels.moe import prefill_tile_row_choices

        if not tensor_core.is_available():
            return (None,)  # the FFMA tiles have one shape
        choices = {rows for each in _layer_layouts(layout) for rows in prefill_tile_row_choices(*_expert_formats(each))}
        return tuple(sorted(choices))

    @contextlib.contextmanager
    def forcing_moe_tile_rows(self, rows: int | None):
        if rows not in self.moe_tile_rows():
            raise ValueError(f"MoE tile rows must be one of {self.moe_tile_rows()}, got {rows}")
        previous, self._forced_tile_rows = self._forced_tile_rows, rows
        try:
            yield
        finally:
            self._forced_tile_rows = previous

    def _moe_block_m(self, num_pairs: int, num_experts: int, layout: ExpertLayout | None) -> int:
        """The forced tile rows where this layer's experts may take them (a mixed model's layers may pick
        between different tiles), else the pick for this chunk."""
        from strata.gpu.kernels.moe import prefill_tile_row_choices, prefill_tile_rows

        formats = _expert_formats(layout)
        if self._forced_tile_rows in prefill_tile_row_choices(*formats):
            return self._forced_tile_rows
        return prefill_tile_rows(num_pairs, num_experts, *formats)

    def moe(self, out, x, ids, weights, storage, slot_of_expert, layout: ExpertLayout, groups=None) -> None:
        """out += the experts of ``slot_of_expert`` ([N] slot or -1, host or device) for the routed ``ids``;
        with ``slot_of_expert`` None, ``ids`` [T, k] on the device are slots already (decode)."""
        from strata.gpu.kernels.moe import moe_experts_decode, moe_experts_prefill, stage_prefill
        from strata.gpu.kernels.moe_route import moe_group

        gate, up, down = storage.matrices(layout)  # in the types of the layer's experts
        num_slots = storage.num_slots_reserved
        is_fixed = isinstance(out, FixedSums)  # then every launch groups its pairs and adds fixed-point units
        out, sums = (out.residual, out.sums) if is_fixed else (out, out)  # sums: the grouped launches' target
        if slot_of_expert is None:
            if is_fixed:
                raise ValueError("fixed-point sums take expert ids and a slot table, not slot ids")
            with self._owning(ACTIVATIONS):
                moe_experts_decode(x, ids, weights, gate, up, down, out, num_experts=num_slots, stream=self._stream)
            return
        if (isinstance(ids, np.ndarray) and isinstance(slot_of_expert, np.ndarray) and x.shape[0] <= DECODE_MAX_ROWS
                and not is_fixed):
            # decode with the routing on the host already: the slots are looked up here, no map launch
            slot_ids = np.where(ids >= 0, slot_of_expert[np.clip(ids, 0, len(slot_of_expert) - 1)], -1)  # [T, k]
            with self._owning(ACTIVATIONS):
                moe_experts_decode(x, self.cuda.to_device(slot_ids.astype(np.int32)), weights, gate, up, down, out,
                                   num_experts=num_slots)
            return
        ids = ids if not isinstance(ids, np.ndarray) else self.cuda.to_device(np.asarray(ids, dtype=np.int32))
        with self._owning(ACTIVATIONS):
            table = slot_of_expert if not isinstance(slot_of_expert, np.ndarray) else \
                self.cuda.to_device(np.asarray(slot_of_expert, dtype=np.int32))
            if groups is not None:  # each launch on its default tiles of the groups' block_m
                if groups.staged_from is not x:
                    reuse, groups.staged = groups.staged, None
                    groups.staged = stage_prefill(x, groups.groups, gate, up, down, num_experts=num_slots, reuse=reuse)
                    groups.staged_from = x
                moe_experts_prefill(x, groups.groups, gate, up, down, sums, num_experts=num_slots,
                                    slot_of_expert=table, staged=groups.staged)
                return
            if x.shape[0] <= DECODE_MAX_ROWS and not is_fixed:
                moe_experts_decode(x, _map_ids(ids, table, to_slots=True, stream=self._stream), weights, gate, up,
                                   down, out, num_experts=num_slots, stream=self._stream)
                return
            # group by expert id (few: the grouping keeps a counter per expert in shared memory),
            # then point each tile at its expert's slot; tensor cores on the GPU (the down launch on
            # tiles of its own), FFMA in the simulator
            block_m = self._moe_block_m(ids.shape[0] * ids.shape[1], table.shape[0], layout)
            groups = moe_group(_map_ids(ids, table, to_slots=False), weights, table.shape[0], block_m)
            tiles = groups.tile_expert.shape[0]
            _tiles_to_slots_kernel()[(tiles + 127) // 128, 128](groups.tile_expert, table, groups.num_tiles)
            moe_experts_prefill(x, groups, gate, up, down, sums, num_experts=num_slots)

    def can_address_experts(self, storage, layout: ExpertLayout, top_k: int) -> bool:
        """Whether ``moe_addressed`` runs a layer of ``layout``'s experts (the C++ rows of their formats)."""
        from strata.gpu.kernels.moe_addressed import can_address

        return can_address(*storage.matrices(layout), top_k)

    def moe_addressed(self, out, x, ids, weights, table, storage, layout: ExpertLayout, host_reads=None) -> None:
        """out += the routed experts ``ids`` [T, k] (expert ids on the device) read at their planes'
        addresses ``table`` [N, C] (``PlaneArena.address_table``): cache slots or pinned host memory;
        host_reads [1] int32 += the routed pairs read from host memory."""
        from strata.gpu.kernels.moe_addressed import moe_experts_addressed

        gate, _, down = storage.matrices(layout)  # formats and row layout of the layer's experts
        with self._owning(ACTIVATIONS):
            moe_experts_addressed(x, ids, weights, table, gate, down, out, host_reads=host_reads,
                                  stream=self._stream)

    def shared_expert_add(self, acc, shared, h, gate_inp) -> None:
        if gate_inp is not None:
            from strata.errors import EngineError

            raise EngineError("a gated shared expert (ffn_gate_inp_shexp) is not supported on the cuda backend yet; "
                              'use runtime.backend = "numpy"')
        self.add(acc.residual if isinstance(acc, FixedSums) else acc, shared)


def _map_ids(ids, table, *, to_slots: bool, stream=0):
    """[T, k] routed ids → their slots (``to_slots``) or themselves, -1 where ``table`` has no slot."""
    from numba import cuda as numba_cuda

    out = numba_cuda.device_array(ids.shape, dtype=np.int32)
    num_pairs = ids.shape[0] * ids.shape[1]
    if num_pairs:
        _map_ids_kernel(to_slots)[(num_pairs + 127) // 128, 128, stream](ids, table, out)
    return out


@functools.cache
def _map_ids_kernel(to_slots: bool):
    @cuda.jit
    def map_ids_kernel(ids, slot_of_expert, out):  # ids, out [T, k]
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        top_k = ids.shape[1]
        if i < ids.shape[0] * top_k:
            expert = ids[i // top_k, i % top_k]
            slot = -1
            if 0 <= expert < slot_of_expert.shape[0]:
                slot = slot_of_expert[expert]
            if slot < 0:
                out[i // top_k, i % top_k] = -1
            elif to_slots:
                out[i // top_k, i % top_k] = slot
            else:
                out[i // top_k, i % top_k] = expert

    return map_ids_kernel


@functools.cache
def _tiles_to_slots_kernel():
    @cuda.jit
    def tiles_to_slots_kernel(tile_expert, slot_of_expert, num_tiles):  # in place: expert id → slot
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i < tile_expert.shape[0] and i < num_tiles[0]:
            expert = tile_expert[i]
            if expert >= 0:
                tile_expert[i] = slot_of_expert[expert]

    return tiles_to_slots_kernel


def _layer_layouts(layout: ExpertLayout | None) -> list:
    """A layer's layout for each set of types a model's layers have, or [layout] itself."""
    if layout is None or not layout.is_mixed:
        return [layout]
    first_layer: dict = {}
    for layer, (qtypes, _) in enumerate(layout.layers, start=layout.first_layer):
        first_layer.setdefault(qtypes, layer)
    return [layout.at_layer(layer) for layer in first_layer.values()]


def _expert_formats(layout: ExpertLayout | None) -> tuple:
    """(formats of gate, up, down; hidden size; FFN size) of the experts, or nothing known without a layout."""
    if layout is None:
        return (), 0, 0
    ffn, dim = layout.shapes[0]
    return tuple(qtype.name for qtype in layout.qtypes), dim, ffn

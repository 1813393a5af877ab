"""The numpy ops backend: the reference ops over host arrays that the ledger treats as VRAM.

It runs the engine's real logic (placement, expert cache and staging, planner, loan, KV cache in
its configured format) on the CPU, so CI serves whole requests. Dense weights are dequantized once
and kept off the ledger (a CPU convenience); experts are decoded from their slot bytes on every use,
as a kernel would read them. Accumulation of expert outputs is float64 so that the order in which
cached and streamed experts are summed does not change the result.

Rows: BLAS multiplies a few rows with other kernels than one row, and vectorised transcendentals may
round an element differently by where it falls in the array, so up to DECODE_MAX_ROWS tokens every op
runs row by row (``_by_row``): each row then has the bits of a one-token call, as decode computes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np

from strata.backend.ops import DECODE_MAX_ROWS, ExpertLayout, QTensor
from strata.errors import EngineError
from strata.gpu.ledger import Charge, VramLedger
from strata.model import quants
from strata.model import reference_ops as ref

_KV_QTYPES = {"q8_0": quants.QType.Q8_0, "q4_0": quants.QType.Q4_0}


class NumpyArena:
    """Reserved range as one lazily committed host buffer; mapped segments are charged to the ledger."""

    def __init__(self, ledger: VramLedger, owner: str, reserved_bytes: int, segment_bytes: int,
                 layout: ExpertLayout, is_backed: bool = True):
        self.reserved_bytes = reserved_bytes
        self.segment_bytes = segment_bytes
        self.slot_bytes = layout.slot_bytes
        # pages are committed on first touch; a dry run only counts
        self.buffer = np.zeros(reserved_bytes if is_backed else 0, dtype=np.uint8)
        self._ledger = ledger
        self._owner = owner
        self._charges: list[Charge] = []

    @property
    def mapped_bytes(self) -> int:
        return len(self._charges) * self.segment_bytes

    @property
    def num_slots(self) -> int:
        return self.slots_in(self.mapped_bytes)

    def slots_in(self, mapped_bytes: int) -> int:
        """Slots ``mapped_bytes`` of mapped segments hold."""
        return mapped_bytes // self.slot_bytes

    def segments_for(self, num_slots: int) -> int:
        """Segments that map at least ``num_slots`` slots."""
        return -(-num_slots * self.slot_bytes // self.segment_bytes)

    def map_segments(self, num_bytes: int) -> None:
        count = num_bytes // self.segment_bytes
        if self.mapped_bytes + count * self.segment_bytes > self.reserved_bytes:
            raise ValueError("mapping beyond the reserved range")
        for _ in range(count):
            self._charges.append(self._ledger.charge(self._owner, self.segment_bytes))

    def unmap_to(self, num_bytes: int) -> None:
        while self.mapped_bytes > num_bytes:
            self._ledger.discharge(self._charges.pop())


class NumpyKv:
    """Per layer K and V [cells, Hk, E] in f16, or GGUF Q8_0/Q4_0 rows of E values. Cells from
    ``resident_cells`` on are the host tier: host memory like the rest here, but not charged to the
    ledger (a GPU backend keeps them in host memory)."""

    def __init__(self, num_layers: int, num_cells: int, num_kv_heads: int, head_dim: int, kv_type: str,
                 resident_cells: int = 0):
        self.kv_type = kv_type
        self.head_dim = head_dim
        self.num_cells = num_cells
        self.resident_cells = resident_cells or num_cells
        if kv_type == "f16":
            shape, dtype = (num_layers, 2, num_cells, num_kv_heads, head_dim), np.float16
        else:
            row = quants.row_nbytes(_KV_QTYPES[kv_type], head_dim)
            shape, dtype = (num_layers, 2, num_cells, num_kv_heads, row), np.uint8
        self.data = np.zeros(shape, dtype=dtype)

    @property
    def cell_bytes(self) -> int:
        return self.data.nbytes // self.num_cells  # K and V of every layer

    def encode(self, x: np.ndarray) -> np.ndarray:
        if self.kv_type == "f16":
            return x.astype(np.float16)
        return (quants.quantize_q8_0 if self.kv_type == "q8_0" else quants.quantize_q4_0)(x)

    def decode(self, layer: int, which: int, end: int) -> np.ndarray:
        stored = self.data[layer, which, :end]
        if self.kv_type == "f16":
            return stored.astype(np.float32)
        shape = (*stored.shape[:-1], self.head_dim)
        return quants.dequantize(np.ascontiguousarray(stored), _KV_QTYPES[self.kv_type], shape)


class NumpyOps:
    name = "numpy"
    is_activation_charged = False  # reference ops make plain arrays: the prompt workspace charges them
    is_copy_overlapped = True  # copies are done on return: nothing to overlap or wait for
    is_deterministic = False  # not consulted: the routed experts add up in float64, rounded once (moe_accumulator)
    is_kv_staged = False  # attention reads a host tier of KV cells where it lies

    def __init__(self, ledger: VramLedger):
        self.ledger = ledger
        self._charges: dict[int, tuple[np.ndarray, Charge]] = {}
        self._dense: dict[int, tuple[object, np.ndarray]] = {}

    # --- memory ---------------------------------------------------------------------------

    def alloc(self, owner: str, shape, dtype) -> np.ndarray:
        return self._track(owner, np.zeros(shape, dtype=dtype))

    def upload(self, owner: str, host: np.ndarray) -> np.ndarray:
        return self._track(owner, np.array(host, copy=True))

    def free(self, array) -> None:
        array = array.data if isinstance(array, QTensor) else array
        self._dense.pop(id(array), None)
        tracked = self._charges.pop(id(array), None)
        if tracked is None:
            raise ValueError("free of an array this backend did not allocate (or freed twice)")
        self.ledger.discharge(tracked[1])

    def upload_qtensor(self, owner: str, raw: np.ndarray, qtype, shape) -> QTensor:
        return self.upload_encoded(owner, self.encode_qtensor(raw, qtype, shape))

    def encode_qtensor(self, raw: np.ndarray, qtype, shape) -> QTensor:
        host = np.ascontiguousarray(raw.reshape(-1, raw.shape[-1]))
        return QTensor(data=host, qtype=qtype, shape=tuple(shape), num_bytes=int(raw.nbytes))

    def pinned(self, host: QTensor) -> QTensor:
        return host  # host memory is all there is

    def upload_encoded(self, owner: str, host: QTensor) -> QTensor:
        return dataclasses.replace(host, data=self.upload(owner, host.data))

    def prefill_kv_scratch_bytes_per_cell(self, head_dim: int, kv_width: int, kv_type: str) -> int:
        return 0

    def prefill_weight_scratch_bytes(self, model, num_layers: int) -> int:
        return 0

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    def host_buffer(self, num_bytes: int) -> np.ndarray:
        return np.empty(num_bytes, dtype=np.uint8)

    def arena(self, owner: str, reserved_bytes: int, segment_bytes: int, layout: ExpertLayout) -> NumpyArena:
        return NumpyArena(self.ledger, owner, reserved_bytes, segment_bytes, layout)

    def arena_view(self, storage: NumpyArena, offset: int, shape, dtype) -> np.ndarray:
        num_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return storage.buffer[offset:offset + num_bytes].view(dtype).reshape(shape)

    def expert_layout(self, model, is_mtp: bool = False) -> ExpertLayout:
        from strata.backend.layouts import expert_layout

        return expert_layout(model, is_mtp=is_mtp)

    def encode_experts(self, raw: np.ndarray, qtype, shape, region_qtypes=()) -> np.ndarray:
        return raw.reshape(raw.shape[0], -1)  # GGUF bytes as they are, at the start of the region

    def stage_experts(self, storage: NumpyArena, slots, hosts, is_after_compute: bool = True) -> None:
        for slot, host in zip(slots, hosts):
            start = int(slot) * storage.slot_bytes
            storage.buffer[start:start + host.size] = host

    def wait_staged(self, ticket) -> None:
        pass

    def slot_tables(self, host: np.ndarray) -> np.ndarray:
        return np.asarray(host, dtype=np.int32)

    def positions(self, start: int, num_tokens: int) -> np.ndarray:
        return np.arange(start, start + num_tokens, dtype=np.int64)

    def synchronize(self) -> None:
        pass

    def timing_mark(self) -> float:
        return time.perf_counter()  # the host runs every op before returning

    def seconds_between(self, started: float, ended: float) -> float:
        return ended - started

    def probe_host_to_device(self) -> None:
        return None  # no device: the planner assumes a rate and says so

    def trim_memory(self) -> None:
        pass  # host buffers are freed when their last reference goes

    def kv_cache(self, owner, num_layers, num_cells, num_kv_heads, head_dim, kv_type, resident_cells: int = 0,
                 staging_owner: str = "") -> NumpyKv:
        """Attention reads the host tier where it lies, so no staging layer is needed here."""
        kv = NumpyKv(num_layers, num_cells, num_kv_heads, head_dim, kv_type, resident_cells)
        charge = self.ledger.charge(owner, kv.data.nbytes // num_cells * kv.resident_cells)
        self._charges[id(kv.data)] = (kv.data, charge)
        return kv

    def close_kv(self, kv: NumpyKv) -> None:
        pass  # the host tier is the cache's own array, freed with it

    def _track(self, owner: str, array: np.ndarray) -> np.ndarray:
        charge = self.ledger.charge(owner, array.nbytes)
        self._charges[id(array)] = (array, charge)
        return array

    def prepare_weights(self, weights: list[QTensor]) -> None:
        for weight in weights:
            self._dequantized(weight)

    def _dequantized(self, weight: QTensor) -> np.ndarray:
        key = id(weight.data)
        if key not in self._dense:
            self._dense[key] = (weight.data, quants.dequantize(weight.data, weight.qtype, weight.shape))
        return self._dense[key][1]

    # --- compute --------------------------------------------------------------------------

    def embed(self, table: QTensor, tokens: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(table.data[tokens])  # [T, row_bytes]
        return quants.dequantize(rows, table.qtype, (len(tokens), table.shape[1]))

    def rms_norm(self, x, weight, eps: float) -> np.ndarray:
        return _by_row(lambda rows: ref.rms_norm(x[rows], weight, eps), len(x))

    def matmul(self, x, weight: QTensor) -> np.ndarray:
        w = self._dequantized(weight)
        return _by_row(lambda rows: (x[rows] @ w.T).astype(np.float32), len(x))

    def project_qkv(self, x, norm, eps: float, wq: QTensor, wk: QTensor, wv: QTensor):
        h = self.rms_norm(x, norm, eps)
        return self.matmul(h, wq), self.matmul(h, wk), self.matmul(h, wv)

    def matmul_add(self, x, y, weight: QTensor) -> None:
        self.add(x, self.matmul(y, weight))

    def prepare_rope(self, num_rope_dims: int, theta: float, freq_factors=None) -> None:
        pass  # angles are computed per call on the host

    def qk_norm_rope(self, q, k, q_norm, k_norm, positions, num_rope_dims, theta, is_neox, eps,
                     freq_factors=None) -> None:
        def rows_norm_rope(rows):
            q_rows, k_rows = q[rows], k[rows]
            if q_norm is not None:
                q_rows = ref.rms_norm(q_rows, q_norm, eps)
                k_rows = ref.rms_norm(k_rows, k_norm, eps)
            cos, sin = ref.rope_angles(positions[rows], num_rope_dims, theta, freq_factors)
            return ref.rope(q_rows, cos, sin, is_neox), ref.rope(k_rows, cos, sin, is_neox)

        q[...], k[...] = _by_row(rows_norm_rope, len(q))

    def qk_norm_rope_kv_write(self, q, k, v, q_norm, k_norm, positions, num_rope_dims, theta, is_neox, eps, kv,
                              layer, start, freq_factors=None) -> None:
        self.qk_norm_rope(q, k, q_norm, k_norm, positions, num_rope_dims, theta, is_neox, eps, freq_factors)
        self.kv_write(kv, layer, start, k, v, positions)

    def kv_write(self, kv: NumpyKv, layer: int, start: int, k, v, positions=None) -> None:
        end = start + k.shape[0]
        kv.data[layer, 0, start:end] = kv.encode(k)
        kv.data[layer, 1, start:end] = kv.encode(v)

    def decode_attention_scratch(self, owner: str, kv: NumpyKv, num_heads: int, num_tokens: int = 1) -> None:
        return None

    def attention(self, q, kv: NumpyKv, layer: int, start: int, positions=None, split_scratch=None) -> np.ndarray:
        def rows_attention(rows):
            first = start + (rows.start or 0)  # the position of the rows' first query
            end = start + (q.shape[0] if rows.stop is None else rows.stop)
            return ref.attention(q[rows], kv.decode(layer, 0, end), kv.decode(layer, 1, end), first)  # [t, Hq, E]

        return _by_row(rows_attention, q.shape[0]).reshape(q.shape[0], -1)

    def route(self, x, router: QTensor, num_used: int, is_norm: bool):
        router64 = self._dequantized(router).T.astype(np.float64)

        def rows_route(rows):
            return ref.route(x[rows].astype(np.float64) @ router64, num_used, is_norm)  # [t, N] logits

        return _by_row(rows_route, len(x))

    def moe_groups(self, ids, weights, num_experts: int, layout: ExpertLayout | None = None, previous=None) -> None:
        return None  # moe walks the routed ids itself

    def moe_tile_rows(self, layout: ExpertLayout | None = None) -> tuple:
        return (None,)

    def forcing_moe_tile_rows(self, rows: int | None):
        return contextlib.nullcontext()

    def moe(self, out, x, ids, weights, storage: NumpyArena, slot_of_expert, layout: ExpertLayout,
            groups=None) -> None:
        for expert in np.unique(ids):
            slot = int(slot_of_expert[expert])
            if slot < 0:
                continue
            gate, up, down = _expert_matrices(storage.buffer, slot, layout)
            rows, ranks = np.nonzero(ids == expert)  # token, place in its top-k
            if len(x) <= DECODE_MAX_ROWS:  # decode rows: each token's experts alone
                y = np.concatenate([ref.ffn(x[row:row + 1], gate, up, down) for row in rows])  # [t, D]
            else:
                y = ref.ffn(x[rows], gate, up, down)  # [t, D]
            out[rows] += y.astype(np.float64) * weights[rows, ranks, None]

    def moe_accumulator(self, x, is_batched: bool = False) -> np.ndarray:
        return np.zeros(x.shape, dtype=np.float64)  # the reference's float64 sum of the experts

    def ffn(self, x, gate: QTensor, up: QTensor, down: QTensor) -> np.ndarray:
        matrices = self._dequantized(gate), self._dequantized(up), self._dequantized(down)
        return _by_row(lambda rows: ref.ffn(x[rows], *matrices), len(x))

    def shared_expert_add(self, acc, shared, h, gate_inp) -> None:
        if gate_inp is not None:
            gate = _by_row(lambda rows: ref.sigmoid(h[rows] @ gate_inp.reshape(-1, 1)), len(h))  # [T, 1]
            shared = shared * gate
        acc += shared

    def add(self, x, y) -> None:
        x += y.astype(x.dtype, copy=False)

    def concat_columns(self, a, b) -> np.ndarray:
        return np.concatenate([a, b], axis=1).astype(np.float32, copy=False)

    def logits(self, x, norm, head: QTensor, eps: float) -> np.ndarray:
        return ref.output_head(x[-1:], norm, self._dequantized(head), eps)[0]

    def logits_rows(self, x, norm, head: QTensor, eps: float) -> np.ndarray:
        if len(x) > DECODE_MAX_ROWS:
            raise EngineError(f"the output head's rows take at most {DECODE_MAX_ROWS} rows, got {len(x)}")
        return np.stack([self.logits(x[t:t + 1], norm, head, eps) for t in range(len(x))])  # [R, V]

    def greedy_rows(self, x, norm, head: QTensor, eps: float, bias, tokens, logits=None) -> None:
        values = self.logits_rows(x, norm, head, eps)  # [R, V]
        if logits is None:
            logits = values
        else:
            logits[:] = values
        if bias is not None:
            for token_id, value in zip(*bias):  # in order, in float32: a repeated id adds twice
                logits[:, token_id] += np.float32(value)
        tokens[:] = np.argmax(logits, axis=-1)  # the lowest id among equals


def _by_row(fn, num_rows: int):
    """fn(slice(None)) of all rows; up to DECODE_MAX_ROWS rows, fn of each row alone, stacked: each row has
    the bits of a one-row call. fn returns an array or a tuple of arrays, row-major."""
    if not 1 < num_rows <= DECODE_MAX_ROWS:
        return fn(slice(None))
    parts = [fn(slice(t, t + 1)) for t in range(num_rows)]
    if isinstance(parts[0], tuple):
        return tuple(np.concatenate(column) for column in zip(*parts))
    return np.concatenate(parts)


def _expert_matrices(buffer: np.ndarray, slot: int, layout: ExpertLayout) -> list[np.ndarray]:
    base = slot * layout.slot_bytes
    mats = []
    for qtype, shape, offset, size in zip(layout.qtypes, layout.shapes, layout.offsets, layout.sizes):
        raw = buffer[base + offset:base + offset + size].reshape(shape[0], -1)
        mats.append(quants.dequantize(raw, qtype, shape))
    return mats

"""The cuda (and cudasim) ops backend: the engine's primitives as Numba kernels.

Weights are repacked at upload into the kernels' planes (``kernels/packing.py``), never
dequantized. Experts live in a ``PlaneArena`` whose slots the MoE kernels index directly: the
engine's expert ids are turned into slot ids per launch on the device, through a slot table [N]
(-1: not in this batch, skipped), so routed ids never have to come back to the host.

Rows: up to DECODE_MAX_ROWS tokens run decode's kernels with a row dimension (multi-row GEMVs that
read each matrix once, the decode attention a block row per token, the decode MoE), each row with
the bits of a one-token call; more tokens run the prefill kernels (GEMM, tensor cores, grouped MoE).

Streams: kernels run on the legacy default stream; expert copies run on a ``CopyStream`` beside
them, ordered by events (``stage_experts`` / ``wait_staged``). Nothing in a prefill chunk waits on
the host, except the upload of the chunk's tokens, positions and slot tables at its start.

Accounting: on the GPU every Numba allocation passes the ledger's memory manager and is charged to
the owner in effect (``ledger.owner``); temporaries of a computation are charged to
``activations``, which must be back to zero between requests. The simulator has no memory
manager, so allocations made through these ops are charged by hand, as the same owners.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time

import numpy as np
from numba import cuda  # a module global: the simulator swaps it inside kernels

from strata.backend.layouts import packed_expert_layout
from strata.backend.ops import DECODE_MAX_ROWS, KV_STAGING_LAYERS, ExpertLayout, QTensor
from strata.gpu import driver_calls
from strata.gpu.ledger import ACTIVATIONS_OWNER as ACTIVATIONS
from strata.gpu.ledger import VramLedger

log = logging.getLogger(__name__)

_KV_FORMATS = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}


class CudaKv:
    """Per layer (K, V) PackedMatrix of ``resident_cells`` rows on the device; with a host tier
    (``resident_cells`` < ``num_cells``), the other cells of each layer in mapped host memory and two
    staging layers of every cell, alternating by layer, that a layer's attention reads (``kernels/kv_tier.py``)."""

    def __init__(self, layers, kv_format: str, num_cells: int, num_kv_heads: int, head_dim: int,
                 host_layers=(), staging=None):
        self.layers = layers  # [(K, V) PackedMatrix] per layer: [resident_cells, W] each
        self.kv_format = kv_format
        self.num_cells = num_cells  # the cells attention may read: the context
        self.resident_cells = layers[0][0].num_rows if layers else num_cells
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.host_layers = host_layers  # [(K, V)] per layer: [num_cells - resident_cells, W] each, or none
        self.staging = staging  # with a host tier, two (K, V) [num_cells, W]: layer l is attended in staging[l % 2]

    @property
    def cell_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers) // self.resident_cells  # K and V of every layer

    @property
    def is_tiered(self) -> bool:
        return bool(self.host_layers)

    def attended(self, layer: int) -> tuple:
        """The (K, V) that ``layer``'s attention reads: with a host tier, the staging layer its kv_write filled."""
        return self.staging[layer % KV_STAGING_LAYERS] if self.is_tiered else self.layers[layer]


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


class CudaOps:
    is_activation_charged = True  # the kernels' allocations go through the ledger as they are made
    is_copy_overlapped = True  # RuntimeSettings.copy_overlap, set by the engine's RuntimeState
    is_kv_staged = True  # a host tier of KV cells is read through staging layers (``kv_cache``)

    def __init__(self, ledger: VramLedger, device: int = 0, is_simulator: bool = False):
        self.ledger = ledger
        self.device = device
        self.is_simulator = is_simulator
        self.name = "cudasim" if is_simulator else "cuda"
        if not is_simulator:
            from strata.gpu.memory import install_ledger

            install_ledger(ledger)
        from numba import cuda

        if not is_simulator:
            quiet_launch_warnings()
        self.cuda = cuda
        # charge by hand where no memory manager sees the allocations: the simulator, or a context
        # that existed before the ledger's manager was installed
        self._is_charged_by_hand = is_simulator
        if not is_simulator:
            from strata.gpu.memory import is_ledger_managed

            cuda.select_device(device)
            self._is_charged_by_hand = not is_ledger_managed()
            if self._is_charged_by_hand:
                log.warning("this process made its CUDA context before the engine installed its memory manager: "
                            "allocations are charged by hand and decode runs without captured graphs (~10x "
                            "slower); call strata.gpu.memory.install_manager() before the first CUDA use")
            _warn_without_tensor_cores()
        self._manual: dict[int, tuple[object, object]] = {}  # charged by hand: id → (array, charge)
        self._capture_owner = None  # the owner charged for a capture's allocations, while it runs
        self._rope: dict[tuple, object] = {}
        # one (1, 1) stand-in per plane dtype for the planes a format lacks, shared by every matrix
        self.placeholders = {name: self.upload("dense_weights", np.zeros((1, 1), dtype))
                             for name, dtype in (("quants", np.uint32), ("scales", np.float16), ("extra", np.uint8))}
        # the simulator runs each block as Python threads: a few SMs keep split decode attention cheap there
        self._num_sms = 4 if is_simulator else cuda.get_current_device().MULTIPROCESSOR_COUNT
        self._stream = 0  # where kernels launch: the default stream, or a graph builder while capturing
        self._forced_tile_rows = None  # the MoE prefill tile rows while forcing_moe_tile_rows is open
        self._copy_stream = None
        # the host tier's copies: the simulator runs every thread in Python, so a few there
        self._tier_launch = dict(blocks=2, threads=32) if is_simulator else {}
        self._kv_fills = None  # AheadFills, made at prefill's first fill ahead
        if not is_simulator:
            from strata.backend.expert_arena import CopyStream

            self._copy_stream = CopyStream()

    # --- memory ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _owning(self, owner: str):
        # while a segment is captured, what its launches allocate is the segment's (``capture``)
        with self.ledger.owner(self._capture_owner or owner):
            yield

    def _track(self, owner: str, arrays, num_bytes: int):
        if self._is_charged_by_hand:
            self._manual[id(arrays)] = (arrays, self.ledger.charge(owner, num_bytes))
        return arrays

    def alloc(self, owner: str, shape, dtype):
        with self._owning(owner):
            array = self.cuda.device_array(shape, dtype=np.dtype(dtype))
        return self._track(owner, array, array.nbytes)

    def upload(self, owner: str, host: np.ndarray):
        with self._owning(owner):
            array = self.cuda.to_device(np.ascontiguousarray(host))
        return self._track(owner, array, array.nbytes)

    def upload_qtensor(self, owner: str, raw: np.ndarray, qtype, shape) -> QTensor:
        """A weight in the packed layout: [rows, row_bytes] GGUF bytes → device planes."""
        return self.upload_encoded(owner, self.encode_qtensor(raw, qtype, shape))

    def encode_qtensor(self, raw: np.ndarray, qtype, shape) -> QTensor:
        """The packed planes on the host (packing a 150 MB head takes ~0.4 s on the host)."""
        from strata.gpu.kernels.packing import pack

        rows = int(np.prod(shape[:-1]))
        packed = pack(raw.reshape(rows, -1), qtype.name, shape[-1])
        return QTensor(data=packed, qtype=qtype, shape=tuple(shape), num_bytes=int(raw.nbytes))

    def prefill_kv_scratch_bytes_per_cell(self, head_dim: int, kv_width: int, kv_type: str) -> int:
        from strata.gpu.kernels import tensor_core

        return kv_scratch_bytes_per_cell(head_dim, kv_width, kv_type,
                                         has_tensor_cores=self.is_simulator or tensor_core.is_available())

    def pinned(self, host: QTensor) -> QTensor:
        """``host``'s packed planes in page-locked memory: a restore uploads them at the pinned PCIe
        rate (55 GB/s on the reference H200, 8 from pageable memory)."""
        if self.is_simulator:
            return host
        packed, planes = host.data, {}
        for name in ("quants", "scales", "extra"):
            plane = getattr(packed, name)
            if isinstance(plane, np.ndarray) and plane.size:
                planes[name] = self.cuda.pinned_array(plane.shape, dtype=plane.dtype)
                planes[name][...] = plane
        return dataclasses.replace(host, data=packed._replace(**planes))

    def upload_encoded(self, owner: str, host: QTensor) -> QTensor:
        from strata.gpu.kernels.packing import plane_shapes

        packed = host.data
        present = plane_shapes(packed.fmt, packed.num_rows, packed.num_cols)
        with self._owning(owner):
            planes = {name: self.cuda.to_device(getattr(packed, name)) if name in present else self.placeholders[name]
                      for name in ("quants", "scales", "extra")}
        device = packed._replace(**planes)
        self._track(owner, device, packed.nbytes)
        return dataclasses.replace(host, data=device)

    def free(self, array) -> None:
        array = array.data if isinstance(array, QTensor) else array
        tracked = self._manual.pop(id(array), None)
        if tracked is not None:
            self.ledger.discharge(tracked[1])
        # on the GPU the memory manager discharges when the last reference goes

    def to_host(self, array) -> np.ndarray:
        return array.copy_to_host() if hasattr(array, "copy_to_host") else np.asarray(array)

    def host_buffer(self, num_bytes: int) -> np.ndarray:
        if self.is_simulator:
            return np.empty(num_bytes, dtype=np.uint8)
        return self.cuda.pinned_array(num_bytes, dtype=np.uint8)  # page-locked: DMA at full PCIe rate

    def arena(self, owner: str, reserved_bytes: int, segment_bytes: int, layout: ExpertLayout):
        from strata.backend.expert_arena import HostRange, PlaneArena

        if self.is_simulator:
            return PlaneArena(self.ledger, owner, reserved_bytes, segment_bytes, layout, granularity=256,
                              make_range=HostRange, placeholders=self.placeholders)
        from strata.gpu.vmm import VmmArena, allocation_granularity

        granularity = allocation_granularity(self.device)
        return PlaneArena(self.ledger, owner, reserved_bytes, segment_bytes, layout, granularity=granularity,
                          make_range=lambda reserved, seg: VmmArena(None, owner, reserved, seg, self.device),
                          placeholders=self.placeholders)

    def expert_layout(self, model, is_mtp: bool = False) -> ExpertLayout:
        return packed_expert_layout(model, is_mtp)

    def encode_experts(self, raw: np.ndarray, qtype, shape, region_qtypes=()) -> np.ndarray:
        """The packed planes of N experts, each plane as wide as the widest of ``region_qtypes``'."""
        from strata.gpu.kernels.packing import pack, padded_planes, plane_shapes, shared_plane_shapes

        num_experts = raw.shape[0]
        packed = pack(raw.reshape(num_experts * shape[0], -1), qtype.name, shape[1])
        fmts = [q.name for q in region_qtypes or (qtype,)]
        shapes = shared_plane_shapes(fmts, num_experts * shape[0], shape[1])
        if shapes == plane_shapes(qtype.name, num_experts * shape[0], shape[1]):
            planes = {name: getattr(packed, name) for name in shapes}  # no padding: the planes as packed
        else:
            planes = padded_planes(packed, shapes)
        parts = [np.ascontiguousarray(p).view(np.uint8).reshape(num_experts, -1) for p in planes.values()]
        return np.concatenate(parts, axis=1)  # [N, planes of one expert]

    def stage_experts(self, storage, slots, hosts, is_after_compute: bool = True):
        if self._copy_stream is None:  # the simulator: copied on return
            storage.stage_many(slots, hosts)
            return None
        ticket = self._copy_stream.stage(storage, slots, hosts, is_after_compute)
        if not self.is_copy_overlapped:
            self._copy_stream.wait(ticket)  # what is issued from here on runs after the copies
        return ticket

    def wait_staged(self, ticket) -> None:
        if ticket is not None:
            self._copy_stream.wait(ticket)

    def slot_tables(self, host: np.ndarray):
        with self._owning(ACTIVATIONS):
            return self.cuda.to_device(np.ascontiguousarray(host, dtype=np.int32))

    def positions(self, start: int, num_tokens: int):
        with self._owning(ACTIVATIONS):
            return self.cuda.to_device(np.arange(start, start + num_tokens, dtype=np.int32))

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def timing_mark(self):
        if self.is_simulator:
            return time.perf_counter()  # the simulator runs every launch before returning
        event = self.cuda.event(timing=True)
        event.record(0)  # the kernels' stream (prefill is not captured)
        return event

    def seconds_between(self, started, ended) -> float:
        if self.is_simulator:
            return ended - started
        return self.cuda.event_elapsed_time(started, ended) / 1e3

    def probe_host_to_device(self) -> list[tuple[int, float]] | None:
        """Pinned copies of a few sizes (``strata/gpu/pcie_probe.py``), their device buffer charged
        as activations and given back; None in the simulator (its copies are host memcpys)."""
        if self.is_simulator:
            return None
        from strata.gpu import pcie_probe

        free = self.ledger.free_bytes
        sizes = tuple(size for size in pcie_probe.SIZES_BYTES if size <= free // 2)
        if not sizes:
            return None
        with self._owning(ACTIVATIONS):
            samples = pcie_probe.probe_host_to_device(sizes, device=self.device)
        self.trim_memory()
        return samples

    @property
    def can_capture(self) -> bool:
        """Whether ``capture`` records graphs (it needs the ledger's memory manager to retain what a
        graph references) or, in the simulator, re-runs segments."""
        return self.is_simulator or not self._is_charged_by_hand

    def capture(self, fn, owner: str = ACTIVATIONS):
        """A segment of launches made by ``fn`` (through these ops), replayed by ``segment.replay()``;
        ``segment.outputs`` is what ``fn`` returned; what it allocates is charged to ``owner`` for
        the segment's life. See ``strata/gpu/graphs.py``."""
        from strata.gpu.graphs import RerunSegment, capture_graph

        if self.is_simulator:
            return RerunSegment(fn)
        outer, self._capture_owner = self._capture_owner, owner
        try:
            with self._owning(owner):
                return capture_graph(fn, self._launching_on, self.cuda.current_context().memory_manager.retaining)
        finally:
            self._capture_owner = outer

    @contextlib.contextmanager
    def _launching_on(self, stream):
        outer, self._stream = self._stream, stream
        try:
            yield
        finally:
            self._stream = outer

    def copy_in(self, array, host: np.ndarray, is_queued: bool = False) -> None:
        """Overwrite a device array with host values (a captured segment's input before its replay).

        is_queued: ``host`` is pinned (``host_buffer``) and the copy is queued on the default stream,
        in order with the kernels, without the host waiting for them; the caller leaves ``host``
        unchanged until the kernels after the copy have run.
        """
        calls = driver_calls.load() if is_queued and not self.is_simulator else None
        if calls is None:
            array.copy_to_device(np.ascontiguousarray(host, dtype=array.dtype))
            return
        if host.dtype != array.dtype or not host.flags.c_contiguous or host.nbytes != array.nbytes:
            raise ValueError(f"a queued copy needs contiguous {array.dtype} host memory of {array.nbytes} bytes")
        calls.copy_one(array.device_ctypes_pointer.value, host.ctypes.data, host.nbytes, 0)

    def prepare_weights(self, weights: list[QTensor]) -> None:
        pass  # the kernels read the packed planes as uploaded

    def trim_memory(self) -> None:
        if not self._is_charged_by_hand:
            from strata.gpu.memory import trim_pool

            self.cuda.synchronize()
            trim_pool(self.ledger)

    def kv_cache(self, owner, num_layers, num_cells, num_kv_heads, head_dim, kv_type, resident_cells: int = 0,
                 staging_owner: str = "") -> CudaKv:
        """resident_cells (0: every cell) of each layer on the device; the other cells, with a host tier,
        in mapped host memory, and two staging layers of every cell charged to ``staging_owner``."""
        from strata.gpu.kernels.kvcache import empty_kv_layer

        fmt, width = _KV_FORMATS[kv_type], num_kv_heads * head_dim
        resident_cells = resident_cells or num_cells
        with self._owning(owner):
            layers = [empty_kv_layer(fmt, resident_cells, width) for _ in range(num_layers)]
        host_layers, staging = (), None
        if resident_cells < num_cells:
            host_layers = [tuple(self._mapped_packed(fmt, num_cells - resident_cells, width) for _ in range(2))
                           for _ in range(num_layers)]
            with self._owning(staging_owner):
                staging = [empty_kv_layer(fmt, num_cells, width) for _ in range(KV_STAGING_LAYERS)]
            self._track(staging_owner, staging, sum(m.nbytes for pair in staging for m in pair))
        kv = CudaKv(layers, fmt, num_cells, num_kv_heads, head_dim, host_layers, staging)
        return self._track(owner, kv, sum(k.nbytes + v.nbytes for k, v in layers))

    def close_kv(self, kv: CudaKv) -> None:
        """The host tier's planes go back to the driver now rather than at a later flush of Numba's pending
        frees (a server loading a model again would hold both tiers' pinned memory), with the fill stream."""
        if self._kv_fills is not None:
            self._kv_fills.close()
            self._kv_fills = None
        if not kv.host_layers:
            return
        kv.host_layers = ()  # their last references: each plane's pinned memory is queued for freeing
        if not self.is_simulator:
            self.cuda.current_context().memory_manager.deallocations.clear()

    def _mapped_packed(self, fmt: str, num_rows: int, num_cols: int):
        """A zeroed packed matrix in page-locked host memory that kernels read and write through its
        device mapping (the simulator's device memory is host memory already)."""
        from strata.gpu.kernels.packing import PackedMatrix, plane_shapes

        planes = {}
        for name, (shape, dtype) in plane_shapes(fmt, num_rows, num_cols).items():
            if self.is_simulator:
                planes[name] = self.cuda.to_device(np.zeros(shape, dtype))
            else:
                planes[name] = self.cuda.mapped_array(shape, dtype)
                np.ndarray.fill(planes[name], 0)  # host memory: numba's view() is the device array's
        return PackedMatrix(fmt, num_rows, num_cols, *(planes.get(n, self.placeholders[n])
                                                       for n in ("quants", "scales", "extra")))

    # --- compute --------------------------------------------------------------------------

    def embed(self, table: QTensor, tokens: np.ndarray, out=None):
        from strata.gpu.kernels.elementwise import embedding

        ids = tokens if hasattr(tokens, "copy_to_host") else self.cuda.to_device(np.asarray(tokens, dtype=np.int32))
        with self._owning(ACTIVATIONS):
            return embedding(table.data, ids, out, stream=self._stream)

    def rms_norm(self, x, weight, eps: float):
        from strata.gpu.kernels.norm import rms_norm

        with self._owning(ACTIVATIONS):
            return rms_norm(x, weight, eps, stream=self._stream)

    def matmul(self, x, weight: QTensor):
        from strata.gpu.kernels.gemm import gemm
        from strata.gpu.kernels.gemv import gemv_rows

        with self._owning(ACTIVATIONS):
            if x.shape[0] <= DECODE_MAX_ROWS:
                return gemv_rows(weight.data, x, stream=self._stream)  # [T, N]
            return gemm(x, weight.data)

    def project_qkv(self, x, norm, eps: float, wq: QTensor, wk: QTensor, wv: QTensor):
        from strata.gpu.kernels.gemv_multi import gemv_multi_rows

        if x.shape[0] > DECODE_MAX_ROWS:
            from strata.gpu.kernels.gemm import staged_input
            from strata.gpu.kernels.gemm_config import default_config

            h = self.rms_norm(x, norm, eps)
            with self._owning(ACTIVATIONS):  # the float16 copy the three GEMMs would each make, made once
                h = staged_input(h, default_config(wq.data.fmt), wq.data.fmt, wk.data.fmt, wv.data.fmt)
            return self.matmul(h, wq), self.matmul(h, wk), self.matmul(h, wv)
        with self._owning(ACTIVATIONS):  # decode rows: each row's norm and the three GEMVs in one launch
            return gemv_multi_rows((wq.data, wk.data, wv.data), x, norm_weight=norm, eps=eps, stream=self._stream)

    def matmul_add(self, x, y, weight: QTensor) -> None:
        from strata.gpu.kernels.gemm import gemm
        from strata.gpu.kernels.gemv import gemv_rows

        if y.shape[0] <= DECODE_MAX_ROWS:
            gemv_rows(weight.data, y, x, accumulate=True, stream=self._stream)
        else:
            with self._owning(ACTIVATIONS):  # gemm may stage a float16 copy of y
                gemm(y, weight.data, x, accumulate=True)

    def qk_norm_rope(self, q, k, q_norm, k_norm, positions, num_rope_dims, theta, is_neox, eps,
                     freq_factors=None, v=None, caches=None) -> None:
        """caches: the layer's resident (K, V), written from the normed and rotated k and ``v`` in the same
        launch (``qk_norm_rope_kv_write``)."""
        from strata.gpu.kernels.rope import head_norm_rope

        num_tokens, _, head_dim = q.shape
        key = self.prepare_rope(num_rope_dims, theta, freq_factors)
        k_cache, v_cache = caches or (None, None)
        with self._owning(ACTIVATIONS):
            head_norm_rope(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1),
                           self._device_positions(positions), head_dim=head_dim,
                           q_norm_weight=q_norm, k_norm_weight=k_norm, eps=eps,
                           rope_mode="neox" if is_neox else "normal", rope_dims=num_rope_dims,
                           inv_freq=self._rope[key], v=None if v is None else v.reshape(num_tokens, -1),
                           k_cache=k_cache, v_cache=v_cache, stream=self._stream)

    def qk_norm_rope_kv_write(self, q, k, v, q_norm, k_norm, positions, num_rope_dims, theta, is_neox, eps,
                              kv: CudaKv, layer: int, start: int, freq_factors=None) -> None:
        """One launch for the heads' norm and rotation and the KV write, where the cache is all resident (a
        host tier fills and writes back its staging layer around the write: two launches there)."""
        from strata.gpu.kernels.kvcache import KV_BLOCK

        num_tokens, _, head_dim = q.shape
        if kv.is_tiered or head_dim % KV_BLOCK:
            self.qk_norm_rope(q, k, q_norm, k_norm, positions, num_rope_dims, theta, is_neox, eps, freq_factors)
            self.kv_write(kv, layer, start, k, v, positions)
            return
        if positions is None:
            positions = self.cuda.to_device(np.arange(start, start + num_tokens, dtype=np.int32))
        self.qk_norm_rope(q, k, q_norm, k_norm, positions, num_rope_dims, theta, is_neox, eps, freq_factors, v=v,
                          caches=kv.layers[layer])

    def prepare_rope(self, num_rope_dims: int, theta: float, freq_factors=None) -> tuple:
        """Upload the RoPE frequency table once, at load, as part of the dense weights."""
        from strata.gpu.kernels.rope import rope_inv_freq

        key = (theta, num_rope_dims, None if freq_factors is None else np.asarray(freq_factors).tobytes())
        if key not in self._rope:
            self._rope[key] = self.upload("dense_weights", rope_inv_freq(theta, num_rope_dims, freq_factors))
        return key

    def _device_positions(self, positions):
        if isinstance(positions, np.ndarray):
            return self.cuda.to_device(np.asarray(positions, dtype=np.int32))
        return positions

    def kv_write(self, kv: CudaKv, layer: int, start: int, k, v, positions=None) -> None:
        from strata.gpu.kernels.kv_tier import fill_kv_window, write_back_kv
        from strata.gpu.kernels.kvcache import append_kv

        num_tokens = k.shape[0]
        if positions is None:
            positions = self.cuda.to_device(np.arange(start, start + num_tokens, dtype=np.int32))
        positions = self._device_positions(positions)
        staging = kv.staging[layer % KV_STAGING_LAYERS] if kv.is_tiered else None
        is_filled = kv.is_tiered and self._kv_fills is not None and \
            self._kv_fills.take((id(kv), layer, start, num_tokens))
        with self._owning(ACTIVATIONS):
            if kv.is_tiered and not is_filled:  # the layer's cells up to the new ones into its staging layer
                fill_kv_window(staging, kv.layers[layer], kv.host_layers[layer], kv.resident_cells, positions,
                               stream=self._stream, **self._tier_launch)
            k_cache, v_cache = staging or kv.layers[layer]
            append_kv(k_cache, v_cache, k.reshape(num_tokens, -1), v.reshape(num_tokens, -1), positions,
                      stream=self._stream)
            if kv.is_tiered:  # the new cells to their home, device or host
                write_back_kv(staging, kv.layers[layer], kv.host_layers[layer], kv.resident_cells, positions,
                              stream=self._stream, **self._tier_launch)

    def decode_attention_scratch(self, owner: str, kv: CudaKv, num_heads: int, num_tokens: int = 1) -> tuple:
        """The split workspace of a decode step's attention (attention.decode_workspace_specs: the direct
        kernel's partials and zeroed counters, or the other kernels' o, m and l); a captured layer that
        allocated its own would keep ~1 MiB per layer at 34k cells."""
        from strata.gpu.kernels.attention import decode_workspace_specs

        specs = decode_workspace_specs(self._decode_splits(kv, num_heads), num_tokens, num_heads, kv.num_kv_heads,
                                       kv.head_dim, k_cache=kv.attended(0)[0])
        return tuple(self.upload(owner, np.zeros(shape, dtype)) if np.dtype(dtype).kind == "i" else
                     self.alloc(owner, shape, dtype) for shape, dtype in specs)

    def _decode_splits(self, kv: CudaKv, num_heads: int) -> int:
        from strata.gpu.kernels.attention import decode_num_splits

        # every layer's planes are allocations of their own, aligned as layer 0's (the direct kernel asks 16 bytes)
        return decode_num_splits(kv.num_cells, kv.num_kv_heads, kv.head_dim, num_heads // kv.num_kv_heads,
                                 self._num_sms, k_cache=kv.attended(0)[0])

    def attention(self, q, kv: CudaKv, layer: int, start: int, positions=None, split_scratch=None):
        from strata.gpu.kernels.attention import (
            attention,
            decode_config,
            uses_tensor_cores,
        )

        num_tokens, num_heads, head_dim = q.shape
        if positions is None:
            positions = np.arange(start, start + num_tokens, dtype=np.int32)
        k_cache, v_cache = kv.attended(layer)
        args = dict(num_q_heads=num_heads, num_kv_heads=kv.num_kv_heads, head_dim=head_dim)
        with self._owning(ACTIVATIONS):
            if num_tokens <= DECODE_MAX_ROWS:  # decode rows: the KV length comes from each row's position on
                # the device, so a captured step replays at any position; the splits are sized for the whole
                # cache, the same for every row count: each row attends as a one-token call of it would
                return attention(q.reshape(num_tokens, -1), k_cache, v_cache, self._device_positions(positions),
                                 kv_len=kv.num_cells, num_splits=self._decode_splits(kv, num_heads),
                                 is_len_from_positions=True, is_decode_rows=True,
                                 config=decode_config(head_dim, num_heads // kv.num_kv_heads),
                                 stream=self._stream, workspace=split_scratch, **args)
            scratch = None
            if k_cache.fmt != "F16" and uses_tensor_cores(num_tokens, 1, head_dim, k_cache.fmt):
                scratch = self._f16_scratch(kv.num_cells, k_cache.num_cols)  # [cells, width] K and V
            positions = self._device_positions(positions)
            out = attention(q.reshape(num_tokens, -1), k_cache, v_cache, positions, kv_len=start + num_tokens,
                            f16_scratch=scratch, **args)
        if kv.is_tiered and layer + 1 < len(kv.layers):
            self._fill_next_layer(kv, layer + 1, start, positions)
        return out

    def _fill_next_layer(self, kv: CudaKv, layer: int, start: int, positions) -> None:
        """Prefill: ``layer``'s fill runs on a stream of its own while this layer's experts compute
        (``kv_fills.py``); where the chunk's copies do not overlap (``is_copy_overlapped``: a ring of two
        slots or more), or while a segment is captured, it runs in its write."""
        if self.is_simulator or not self.is_copy_overlapped or self._stream != 0:
            return
        from strata.gpu.kernels.kv_tier import fill_kv_window

        if self._kv_fills is None:
            from strata.backend.kv_fills import AheadFills

            self._kv_fills = AheadFills()
        self._kv_fills.fill_ahead((id(kv), layer, start, positions.shape[0]), positions, lambda stream: fill_kv_window(
            kv.staging[layer % KV_STAGING_LAYERS], kv.layers[layer], kv.host_layers[layer], kv.resident_cells,
            positions, stream=stream, **self._tier_launch))

    def _f16_scratch(self, num_rows: int, width: int):
        """Two F16 matrices a quantized cache layer is dequantized into for prefill attention; sized
        for the whole cache, so every layer and chunk reuses the same pooled blocks."""
        from strata.gpu.kernels.packing import PackedMatrix

        return tuple(PackedMatrix("F16", num_rows, width, self.cuda.device_array((num_rows, width), np.float16),
                                  self.placeholders["scales"], self.placeholders["extra"]) for _ in range(2))

    def route(self, x, router: QTensor, num_used: int, is_norm: bool):
        from strata.gpu.kernels.moe_route import moe_route

        logits = self.matmul(x, router)
        with self._owning(ACTIVATIONS):
            ids, weights = moe_route(logits, num_used, norm_weights=is_norm, stream=self._stream)
        return ids, weights  # [T, k] int32 on the device; to_host when the host must pick experts

    def moe_accumulator(self, x):
        return x  # the MoE kernels add into the residual stream: no zeroed array, no extra add

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
        if slot_of_expert is None:
            with self._owning(ACTIVATIONS):
                moe_experts_decode(x, ids, weights, gate, up, down, out, num_experts=num_slots, stream=self._stream)
            return
        if isinstance(ids, np.ndarray) and isinstance(slot_of_expert, np.ndarray) and x.shape[0] <= DECODE_MAX_ROWS:
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
                moe_experts_prefill(x, groups.groups, gate, up, down, out, num_experts=num_slots, slot_of_expert=table,
                                    staged=groups.staged)
                return
            if x.shape[0] <= DECODE_MAX_ROWS:
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
            moe_experts_prefill(x, groups, gate, up, down, out, num_experts=num_slots)

    def ffn(self, x, gate: QTensor, up: QTensor, down: QTensor):
        from strata.gpu.kernels.activation import swiglu

        g, u = self.matmul(x, gate), self.matmul(x, up)
        with self._owning(ACTIVATIONS):
            hidden = swiglu(g, u)
        return self.matmul(hidden, down)

    def shared_expert_add(self, acc, shared, h, gate_inp) -> None:
        if gate_inp is not None:
            from strata.errors import EngineError

            raise EngineError("a gated shared expert (ffn_gate_inp_shexp) is not supported on the cuda backend yet; "
                              'use runtime.backend = "numpy"')
        self.add(acc, shared)

    def add(self, x, y) -> None:
        from strata.gpu.kernels.elementwise import add

        if y is not x:  # x as its own accumulator already holds the sum
            add(x, y)

    def concat_columns(self, a, b):
        from strata.gpu.kernels.concat import concat_columns

        with self._owning(ACTIVATIONS):
            return concat_columns(a, b, stream=self._stream)

    def copy_array(self, dst, src) -> None:
        """dst[...] = src on the device, by a kernel (a captured segment may hold it)."""
        from strata.gpu.kernels.concat import copy_array

        copy_array(dst, src, stream=self._stream)

    def logits(self, x, norm, head: QTensor, eps: float) -> np.ndarray:
        from strata.gpu.kernels.gemv import gemv
        from strata.gpu.kernels.gemv_native import head_config

        last = x[x.shape[0] - 1:] if hasattr(x, "copy_to_host") else self.cuda.to_device(np.asarray(x[-1:]))
        with self._owning(ACTIVATIONS):
            return gemv(head.data, last[0], norm_weight=norm, eps=eps,
                        native_config=head_config(head.data.fmt)).copy_to_host()

    def greedy_token(self, x, norm, head: QTensor, eps: float, bias, token) -> None:
        """token [1] int32 (device) = the argmax of the last row's logits (the same kernel as
        ``logits``) after adding ``bias`` (device ids [n] int32 and values [n] float32, or None); the
        lowest id among equals, as the host's ``np.argmax``. Nothing returns to the host."""
        from strata.gpu.kernels.gemv import gemv
        from strata.gpu.kernels.gemv_native import head_config
        from strata.gpu.kernels.sample import add_logit_bias, argmax

        with self._owning(ACTIVATIONS):
            logits = gemv(head.data, x[x.shape[0] - 1], norm_weight=norm, eps=eps,
                          native_config=head_config(head.data.fmt), stream=self._stream)  # [V]
            if bias is not None:
                add_logit_bias(logits, *bias, stream=self._stream)
            # the simulator runs every thread in Python: a few small blocks there
            shape = dict(num_blocks=2, threads=32) if self.is_simulator else {}
            argmax(logits, token=token, stream=self._stream, **shape)

    def logits_rows(self, x, norm, head: QTensor, eps: float) -> np.ndarray:
        """[R, V] float32 on the host, row r the bits of ``logits`` of x[r] alone (the head's rows GEMV)."""
        with self._owning(ACTIVATIONS):
            return self._head_rows(x, norm, head, eps).copy_to_host()

    def greedy_rows(self, x, norm, head: QTensor, eps: float, bias, tokens, logits=None) -> None:
        """tokens [R] int32 (device) = per row of x, what ``greedy_token`` picks for that row alone: the
        argmax after ``bias``, the lowest id among equals. Nothing returns to the host."""
        from strata.gpu.kernels.sample import add_logit_bias, argmax

        with self._owning(ACTIVATIONS):
            logits = self._head_rows(x, norm, head, eps, logits)  # [R, V]
            shape = dict(num_blocks=2, threads=32) if self.is_simulator else {}
            for row in range(logits.shape[0]):
                if bias is not None:
                    add_logit_bias(logits[row], *bias, stream=self._stream)
                argmax(logits[row], token=tokens[row:row + 1], stream=self._stream, **shape)

    def _head_rows(self, x, norm, head: QTensor, eps: float, out=None):
        """[R, V] logits of every row of x on the device: the output head's rows GEMV (``logits``' kernel)."""
        from strata.gpu.kernels.gemv import gemv_rows
        from strata.gpu.kernels.gemv_native import head_rows_config

        if x.shape[0] > DECODE_MAX_ROWS:
            from strata.errors import EngineError

            raise EngineError(f"the output head's rows take at most {DECODE_MAX_ROWS} rows, got {x.shape[0]}")
        rows = x if hasattr(x, "copy_to_host") else self.cuda.to_device(np.ascontiguousarray(x, dtype=np.float32))
        return gemv_rows(head.data, rows, out, norm_weight=norm, eps=eps, stream=self._stream,
                         native_config=head_rows_config(head.data.fmt, x.shape[0]))

    def increment(self, values) -> None:
        from strata.gpu.kernels.elementwise import increment

        increment(values, stream=self._stream)

    def override_token(self, token, overrides, place) -> None:
        """token [1] = overrides[place] where that is >= 0; place += 1 (the bench's draft oracle, on the device)."""
        from strata.gpu.kernels.elementwise import override_token

        override_token(token, overrides, place, stream=self._stream)

    def readback(self):
        """A ``Readback`` (``strata/gpu/readback.py``): token ids and small arrays back through pinned memory."""
        from strata.gpu.readback import PINNED_BYTES, Readback

        calls = None if self.is_simulator else driver_calls.load()
        return Readback(self.host_buffer(PINNED_BYTES) if calls else None, calls)


def kv_scratch_bytes_per_cell(head_dim: int, kv_width: int, kv_type: str, *, has_tensor_cores: bool) -> int:
    """The F16 copy (K and V) a quantized cache layer is dequantized into for tensor-core prefill
    attention (``attention`` above), per cell; 0 where that kernel does not run."""
    from strata.gpu.kernels.attention_mma import is_supported

    fmt = _KV_FORMATS[kv_type]
    return 4 * kv_width if fmt != "F16" and has_tensor_cores and is_supported(head_dim, fmt) else 0


def _warn_without_tensor_cores() -> None:
    from strata.gpu.kernels import tensor_core

    reason = tensor_core.unavailable_reason()
    if reason is not None:
        log.warning("the tensor-core kernels are off: %s. Prefill runs the pure-Numba kernels, several times slower "
                    "(FFMA peaks near 15 TFLOP/s)", reason)


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


def quiet_launch_warnings() -> None:
    """Numba-CUDA checks every launch's grid and warns below 128 blocks; decode launches grids that
    small on purpose. The check is switched off, not only filtered: web frameworks enter
    ``warnings.catch_warnings`` per request, which resets the registry that shows a warning once,
    so in a serving process every small launch could format and log its warning again. numba-cuda's
    warning is its own class, not ``numba.core``'s (the filter this replaced never matched it)."""
    import warnings

    from numba.core.errors import NumbaPerformanceWarning
    from numba.cuda import dispatcher
    from numba.cuda.core.errors import NumbaPerformanceWarning as CudaPerformanceWarning

    dispatcher.config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
    for category in (NumbaPerformanceWarning, CudaPerformanceWarning):
        warnings.simplefilter("ignore", category)

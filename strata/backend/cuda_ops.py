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

This file holds memory, streams, capture and the dense compute; the KV cache and attention
(``cuda_attention_ops.py``), the routed experts (``cuda_moe_ops.py``) and the output head
(``cuda_head_ops.py``) are the classes ``CudaOps`` takes them from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import numpy as np

from strata.backend.cuda_attention_ops import AttentionOps
from strata.backend.cuda_head_ops import HeadOps
from strata.backend.cuda_moe_ops import FixedSums, MoeOps
from strata.backend.layouts import packed_expert_layout
from strata.backend.ops import DECODE_MAX_ROWS, ExpertLayout, QTensor
from strata.gpu import driver_calls
from strata.gpu.ledger import ACTIVATIONS_OWNER as ACTIVATIONS
from strata.gpu.ledger import VramLedger

log = logging.getLogger(__name__)


class CudaOps(AttentionOps, MoeOps, HeadOps):
    is_activation_charged = True  # the kernels' allocations go through the ledger as they are made
    is_copy_overlapped = True  # RuntimeSettings.copy_overlap, set by the engine's RuntimeState
    is_deterministic = False  # runtime.deterministic: prefill's routed experts add up in fixed point (FixedSums)
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
        calls.copy_one(array.device_ctypes_pointer.value, driver_calls.host_address(host), host.nbytes, 0)

    def prepare_weights(self, weights: list[QTensor]) -> None:
        pass  # the kernels read the packed planes as uploaded

    def trim_memory(self) -> None:
        from strata.gpu.descriptor_cache import trim_descriptor_cache

        trim_descriptor_cache()  # numba-cuda's unbounded memo of array layouts (every prompt length adds some)
        if not self._is_charged_by_hand:
            from strata.gpu.memory import trim_pool

            self.cuda.synchronize()
            trim_pool(self.ledger)

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

    def prefill_weight_scratch_bytes(self, model, num_layers: int) -> int:
        from strata.gpu.kernels import tensor_core

        return weight_scratch_bytes(model, num_layers, has_tensor_cores=tensor_core.is_available())

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
            from strata.gpu.kernels.gemm import launch_format, staged_input
            from strata.gpu.kernels.gemm_config import default_config, is_fused

            h = self.rms_norm(x, norm, eps)
            formats = [launch_format(w.data.fmt) for w in (wq, wk, wv)]  # what each GEMM's main loop reads
            with self._owning(ACTIVATIONS):  # the float16 copy each fused GEMM would make, made once
                if all(is_fused(default_config(fmt), fmt) for fmt in formats):
                    h = staged_input(h, default_config(formats[0]), formats[0])
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

    def ffn(self, x, gate: QTensor, up: QTensor, down: QTensor):
        from strata.gpu.kernels.activation import swiglu

        g, u = self.matmul(x, gate), self.matmul(x, up)
        with self._owning(ACTIVATIONS):
            hidden = swiglu(g, u)
        return self.matmul(hidden, down)

    def add(self, x, y) -> None:
        from strata.gpu.kernels.elementwise import add

        if isinstance(y, FixedSums):  # x's own accumulator, its routed experts' sums apart
            from strata.gpu.kernels.fixed_sums import add_fixed_sums

            add_fixed_sums(x, y.sums)
        elif y is not x:  # x as its own accumulator already holds the sum
            add(x, y)

    def concat_columns(self, a, b):
        from strata.gpu.kernels.concat import concat_columns

        with self._owning(ACTIVATIONS):
            return concat_columns(a, b, stream=self._stream)

    def copy_array(self, dst, src) -> None:
        """dst[...] = src on the device, by a kernel (a captured segment may hold it)."""
        from strata.gpu.kernels.concat import copy_array

        copy_array(dst, src, stream=self._stream)


def _warn_without_tensor_cores() -> None:
    from strata.gpu.kernels import tensor_core

    reason = tensor_core.unavailable_reason()
    if reason is not None:
        log.warning("the tensor-core kernels are off: %s. Prefill runs the pure-Numba kernels, several times slower "
                    "(FFMA peaks near 15 TFLOP/s)", reason)


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


# a layer's matrices that prefill multiplies with gemm (the routed experts, the MTP block's embedding and head do not)
_GEMM_TENSORS = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.", "ffn_down.",
                 "ffn_gate_shexp.", "ffn_up_shexp.", "ffn_down_shexp.", "ffn_gate_inp.", "eh_proj.")


def weight_scratch_bytes(model, num_layers: int, *, has_tensor_cores: bool) -> int:
    """The float16 copy of the largest matrix of layers 0 .. num_layers - 1 that ``gemm`` stages before its
    launch (a format its fused loop does not read: ``is_staged_as_f16``); 0 without tensor cores, where nothing
    is staged."""
    from strata.gpu.kernels.gemm import f16_staging_bytes, is_staged_as_f16
    from strata.model.gguf_file import layer_of

    if not has_tensor_cores:
        return 0
    largest = 0
    for name, ref in model.tensors.items():
        layer = layer_of(name)
        if (layer is not None and layer < num_layers and len(ref.shape) == 2
                and any(part in name for part in _GEMM_TENSORS) and is_staged_as_f16(ref.qtype.name)):
            largest = max(largest, f16_staging_bytes(ref.shape[0], ref.shape[1]))
    return largest

"""The ops backend: the memory and compute primitives the engine is written over, once.

Three implementations: ``numpy`` (the reference ops on host memory that the ledger treats as
device memory; CI runs whole requests on it), ``cuda`` (Numba kernels on the GPU) and ``cudasim``
(the same kernels under the CUDA simulator). The engine never touches a backend array directly:
it passes them back to the ops that made them. Every allocation is charged to the ledger under an
owner; ``to_host`` is the only way data comes back.

Shapes: T tokens, D hidden size, Hq/Hk query/KV heads of E dims, N experts, k experts per token.

Rows: for 1 <= T <= DECODE_MAX_ROWS every compute op gives each of the T rows the bits of the same op
on that row alone (at its own position), and on the GPU reads each weight matrix once for all the
rows: a speculative verify (the last accepted token and its drafts as one forward) then reproduces
plain decode bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.gpu.ledger import VramLedger


DECODE_MAX_ROWS = 9  # the rows a forward computes with decode's row kernels, each bit-identical to one row alone
KV_STAGING_LAYERS = 2  # a tiered KV cache's staging layers on a GPU: layer l is attended in staging[l % 2]


@dataclasses.dataclass(frozen=True)
class QTensor:
    """A weight on the backend in its GGUF bytes: ``data`` [rows, row_bytes] uint8, logical ``shape``."""

    data: Any
    qtype: QType
    shape: tuple[int, ...]
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where an expert's three matrices sit inside its slot (byte offsets, each 256-byte aligned).

    A model's layout describes the experts of every main layer (an MTP block's have a layout of their
    own): where a matrix's type changes between layers (llama.cpp's Q4_K_M gives some layers'
    ffn_down_exps Q6_K), its region holds the largest of its types, and ``at_layer`` gives one layer's
    types and sizes in the same slot geometry."""

    qtypes: tuple[QType, QType, QType]  # gate, up, down (of layer 0 in a model's layout)
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]  # [F, D], [F, D], [D, F]
    offsets: tuple[int, int, int]
    sizes: tuple[int, int, int]  # the bytes each matrix of ``qtypes`` fills from its offset
    slot_bytes: int
    encoding: str = "gguf"  # how each matrix's bytes are laid out in its region; the backend's choice
    # every layer's (qtypes, sizes) from ``first_layer`` on (the main layers, or an MTP block); () where
    # every layer has ``qtypes``
    layers: tuple[tuple[tuple[QType, QType, QType], tuple[int, int, int]], ...] = ()
    first_layer: int = 0

    @property
    def is_mixed(self) -> bool:
        """Whether a matrix's type changes between layers."""
        return len({qtypes for qtypes, _ in self.layers}) > 1

    @property
    def matrix_qtypes(self) -> tuple[tuple[QType, ...], tuple[QType, ...], tuple[QType, ...]]:
        """The types each of gate, up and down's regions holds (``region_qtypes``)."""
        return region_qtypes([qtypes for qtypes, _ in self.layers] or [self.qtypes])

    def at_layer(self, layer: int) -> ExpertLayout:
        """The experts of ``layer``: their types and sizes, in this slot geometry."""
        if not self.layers:
            return self
        qtypes, sizes = self.layers[layer - self.first_layer]
        return dataclasses.replace(self, qtypes=qtypes, sizes=sizes)


def region_qtypes(layer_qtypes) -> tuple[tuple[QType, ...], tuple[QType, ...], tuple[QType, ...]]:
    """The types the slot regions of gate, up and down hold, given every layer's (gate, up, down) types: each
    matrix's types over the layers, in layer order; gate and up share theirs (kernels read both at one pitch)."""
    gate_up = tuple(dict.fromkeys(q for qtypes in layer_qtypes for q in qtypes[:2]))
    return gate_up, gate_up, tuple(dict.fromkeys(qtypes[2] for qtypes in layer_qtypes))


class ArenaStorage(Protocol):
    """A reserved address range of expert slots, mapped in segments (CUDA virtual memory on the GPU).

    ``segment_bytes`` is what one mapped segment costs in the ledger; ``num_slots`` the whole expert
    slots the mapped segments hold.
    """

    reserved_bytes: int
    segment_bytes: int
    mapped_bytes: int
    num_slots: int

    def segments_for(self, num_slots: int) -> int: ...
    def slots_in(self, mapped_bytes: int) -> int:
        """The whole expert slots ``mapped_bytes`` of mapped segments hold."""

    def map_segments(self, num_bytes: int) -> None: ...

    def unmap_to(self, num_bytes: int) -> None: ...


class Ops(Protocol):
    name: str
    ledger: VramLedger
    is_activation_charged: bool  # prefill activations are charged as allocated (else the workspace charges them)
    is_copy_overlapped: bool  # RuntimeSettings.copy_overlap: see stage_experts
    is_deterministic: bool  # runtime.deterministic: prefill's MoE sums the same in any order (moe_accumulator)

    # memory
    def alloc(self, owner: str, shape: tuple[int, ...], dtype: Any) -> Any: ...
    def upload(self, owner: str, host: np.ndarray) -> Any: ...
    def upload_qtensor(self, owner: str, raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> QTensor: ...
    def encode_qtensor(self, raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> QTensor:
        """The weight in this backend's layout, still on the host: what ``upload_encoded`` copies
        (a weight uploaded many times is encoded once)."""
    def pinned(self, host: QTensor) -> QTensor:
        """An encoded host copy in page-locked memory, where the backend has it: uploads run faster."""
    def upload_encoded(self, owner: str, host: QTensor) -> QTensor: ...
    def prefill_kv_scratch_bytes_per_cell(self, head_dim: int, kv_width: int, kv_type: str) -> int:
        """VRAM per KV cell that prefill attention needs besides the cache (on the GPU: a quantized
        layer's F16 copy, K and V), reserved by the planner as fixed workspace."""
    def prefill_weight_scratch_bytes(self, model: Any, num_layers: int) -> int:
        """VRAM prefill's dense products need besides the weights, over layers 0 .. num_layers - 1 (the MTP
        block's too where it runs): on the GPU, the largest dense matrix of a format the fused GEMM does not
        read, staged as float16. The planner reserves it as fixed workspace."""
    def free(self, array: Any) -> None: ...
    def to_host(self, array: Any) -> np.ndarray: ...
    def host_buffer(self, num_bytes: int) -> np.ndarray: ...
    def arena(self, owner: str, reserved_bytes: int, segment_bytes: int, layout: ExpertLayout) -> ArenaStorage: ...
    def arena_view(self, storage: ArenaStorage, offset: int, shape: tuple[int, ...], dtype: Any) -> Any: ...
    def expert_layout(self, model: Any, is_mtp: bool = False) -> ExpertLayout:
        """The main layers' slot layout in this backend's encoding, or with ``is_mtp`` the first MTP block's."""
    def encode_experts(self, raw: np.ndarray, qtype: QType, shape: tuple[int, int],
                       region_qtypes: tuple[QType, ...] = ()) -> np.ndarray:
        """[N, rows, row_bytes] GGUF bytes of N experts' matrix -> [N, size] in this backend's encoding, for
        a slot region that holds any of ``region_qtypes`` (the matrix's types over the layers; () its own)."""

    def stage_experts(self, storage: ArenaStorage, slots: Sequence[int], hosts: Sequence[np.ndarray],
                      is_after_compute: bool = True) -> Any:
        """Copy experts from host memory (``hosts[i]``, one packed slot each) into ``slots[i]``, after
        every computation issued so far. May run asynchronously (a copy stream): returns a ticket
        (None when the copies are done on return) that ``wait_staged`` takes. With
        ``is_copy_overlapped`` false, computations issued after this call wait for its copies.

        is_after_compute=False: the copies need not wait for computations issued so far, because the
        caller knows none of those still running reads ``slots`` (it has read back a result issued
        after every earlier reader, and what it issued since reads other slots)."""
    def wait_staged(self, ticket: Any) -> None:
        """Computations issued from now on read the copies of ``ticket``."""
    def slot_tables(self, host: np.ndarray) -> Any:
        """[B, N] int32 slot tables (slot of each expert, -1: none) on the backend, for ``moe``."""
    def positions(self, start: int, num_tokens: int) -> Any:
        """[T] token positions start.. on the backend, for ``qk_norm_rope``, ``kv_write``, ``attention``."""
    def synchronize(self) -> None: ...
    def timing_mark(self) -> Any:
        """A mark in the kernels' stream (an event on the GPU, the host's clock where the backend
        runs synchronously); ``seconds_between`` two marks, read after ``synchronize``."""
    def seconds_between(self, started: Any, ended: Any) -> float: ...
    def probe_host_to_device(self) -> list[tuple[int, float]] | None:
        """(bytes, seconds) of pinned host-to-device copies (``strata/gpu/pcie_probe.py``), or None
        where there is no device to copy to."""
    # Backends that capture launch sequences (``can_capture``) also have ``capture(fn)`` (a segment
    # whose ``replay()`` runs what ``fn`` launched and whose ``outputs`` are what it returned),
    # ``copy_in(array, host)``, ``embed(..., out=)`` and ``decode_route`` (a decode step's norm and routing,
    # its ids mapped to slots on the device): the decode step replays per-layer segments.
    def trim_memory(self) -> None:
        """Give device memory kept only for reuse (freed temporaries) back, so the ledger shows what
        is resident. Called between requests."""
    def prepare_weights(self, weights: list[QTensor]) -> None:
        """Ready the matrices the forward pass multiplies by now, at load, rather than inside the first
        request: the numpy backend dequantizes them (its matmuls read float32 copies); a GPU backend
        reads the packed planes as uploaded and has nothing to do."""

    # compute
    def embed(self, table: QTensor, tokens: Any) -> Any: ...  # [T] ids (host; a backend may take its own) -> [T, D]
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any: ...
    def matmul(self, x: Any, weight: QTensor) -> Any: ...  # [T, K] x [N, K] -> [T, N]
    def project_qkv(self, x: Any, norm: Any, eps: float, wq: QTensor, wk: QTensor,
                    wv: QTensor) -> tuple[Any, Any, Any]:
        """rms_norm(x) times each of wq, wk, wv: [T, D] -> ([T, Nq], [T, Nk], [T, Nv])."""

    def matmul_add(self, x: Any, y: Any, weight: QTensor) -> None: ...  # x [T, N] += y [T, K] W^T
    def prepare_rope(self, num_rope_dims: int, theta: float, freq_factors: np.ndarray | None = None) -> Any: ...
    def qk_norm_rope(self, q: Any, k: Any, q_norm: Any | None, k_norm: Any | None, positions: Any,
                     num_rope_dims: int, theta: float, is_neox: bool, eps: float,
                     freq_factors: np.ndarray | None = None) -> None: ...
    def kv_cache(self, owner: str, num_layers: int, num_cells: int, num_kv_heads: int, head_dim: int,
                 kv_type: str, resident_cells: int = 0, staging_owner: str = "") -> Any:
        """``num_cells`` per layer, the first ``resident_cells`` (0: all) charged to ``owner``; the others
        are the host tier, read through staging layers charged to ``staging_owner`` where the backend
        needs one. Attention over a tiered cache computes what it computes over a resident one."""
    def close_kv(self, kv: Any) -> None:
        """Release what ``kv`` holds outside the ledger, now: a host tier's pinned planes and the stream
        that fills its staging layers ahead. The cache is not read again; a second call does nothing."""
    def kv_write(self, kv: Any, layer: int, start: int, k: Any, v: Any, positions: Any = None) -> None: ...
    def qk_norm_rope_kv_write(self, q: Any, k: Any, v: Any, q_norm: Any | None, k_norm: Any | None, positions: Any,
                              num_rope_dims: int, theta: float, is_neox: bool, eps: float, kv: Any, layer: int,
                              start: int, freq_factors: np.ndarray | None = None) -> None:
        """``qk_norm_rope`` then ``kv_write`` of the normed and rotated k and v (one launch where the backend
        can)."""
    def attention(self, q: Any, kv: Any, layer: int, start: int, positions: Any = None,
                  split_scratch: Any = None) -> Any: ...  # -> [T, Hq*E]
    def decode_attention_scratch(self, owner: str, kv: Any, num_heads: int, num_tokens: int = 1) -> Any:
        """Scratch for the attention of ``num_tokens`` decode rows (``attention(..., split_scratch=)``),
        shared by every layer: the layers run one after another on one stream. None where the backend
        needs none."""
    def route(self, x: Any, router: QTensor, num_used: int, is_norm: bool) -> tuple[Any, Any]:
        """ids [T, k] and weights [T, k] on the backend (``to_host`` the ids to pick experts there)."""
    def moe_groups(self, ids: Any, weights: Any, num_experts: int, layout: ExpertLayout | None = None,
                   previous: Any = None) -> Any:
        """The routed pairs grouped by expert once, for every ``moe`` call of a layer (None where the
        backend does not group); ``layout`` (the experts' formats and shapes) may decide the tiles;
        ``previous``: the chunk's previous layer's groups, whose buffers this layer's may take."""
    def moe_tile_rows(self, layout: ExpertLayout | None = None) -> tuple:
        """The tile rows the backend's MoE prefill picks between per chunk for experts of ``layout`` (None:
        any), each its own compiled kernels; (None,) where it has no choice. Never empty."""
    def forcing_moe_tile_rows(self, rows: int | None) -> AbstractContextManager:
        """While open, every MoE prefill grouping takes tiles of ``rows`` (one of ``moe_tile_rows``; None:
        the backend's choice). The warm-up compiles each tile's kernels this way."""

    def moe(self, out: Any, x: Any, ids: Any, weights: Any, storage: ArenaStorage, slot_of_expert: Any,
            layout: ExpertLayout, groups: Any = None) -> None:
        """out += the routed experts that ``slot_of_expert`` ([N], host or from ``slot_tables``) places;
        ``layout`` is their layer's (``ExpertLayout.at_layer``: the types its experts' slots hold);
        ``groups`` from ``moe_groups`` over the same ids and weights, or None."""
    def moe_accumulator(self, x: Any, is_batched: bool = False) -> Any:
        """Where a layer's expert outputs add up: a zeroed array shaped like ``x`` [T, D], or ``x``
        itself where the backend adds them straight into the residual stream, or (``is_deterministic``) a
        backend's sums that come out the same in any order, where a layer's ``moe`` calls may add in several
        launches (``is_batched``: prefill's ring batches) or many rows; then ``add(x, acc)``."""
    def ffn(self, x: Any, gate: QTensor, up: QTensor, down: QTensor) -> Any: ...
    def shared_expert_add(self, acc: Any, shared: Any, h: Any, gate_inp: Any | None) -> None: ...
    def add(self, x: Any, y: Any) -> None: ...  # x += y (nothing when y is x itself; a backend's sums folded in)
    def concat_columns(self, a: Any, b: Any) -> Any: ...  # [R, Da], [R, Db] -> [R, Da + Db]
    def logits(self, x: Any, norm: Any, head: QTensor, eps: float) -> np.ndarray: ...  # last row -> [V] host
    def logits_rows(self, x: Any, norm: Any, head: QTensor, eps: float) -> np.ndarray:
        """[R, V] float32 on the host: row r is ``logits`` of x[r] alone (R <= DECODE_MAX_ROWS)."""
    def greedy_rows(self, x: Any, norm: Any, head: QTensor, eps: float, bias: Any, tokens: Any,
                    logits: Any = None) -> None:
        """tokens [R] int32 (on the backend) = per row of x, the argmax of its logits (as ``logits_rows``)
        after adding ``bias`` (backend ids [n] int32 and values [n] float32, or None), the lowest id among
        equals: row r's token is what ``greedy_token`` picks for x[r] alone. Nothing returns to the host.
        logits: [R, V] float32 on the backend to compute them in (None: allocated for the call)."""


def host_tier_bytes(kv: Any, start: int, end: int) -> int:
    """KV bytes a forward that writes cells [start, end) moves between the host tier (cells from
    ``kv.resident_cells`` on) and the GPU: attention reads every cell before ``end``, and the new
    cells in the tier are written back. ``kv.cell_bytes``: K and V of one cell of every layer."""
    resident = kv.resident_cells
    if resident >= kv.num_cells:
        return 0
    return (max(0, end - resident) + max(0, end - max(start, resident))) * kv.cell_bytes

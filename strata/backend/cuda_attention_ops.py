"""The cuda backend's KV cache and attention (``CudaOps`` takes them from ``AttentionOps``): per layer
(K, V) packed matrices on the device, a host tier of cells read through two staging layers, the heads'
norm and RoPE with the KV write, and prefill and decode attention."""

from __future__ import annotations

import numpy as np

from strata.backend.ops import DECODE_MAX_ROWS, KV_STAGING_LAYERS
from strata.gpu.ledger import ACTIVATIONS_OWNER as ACTIVATIONS

KV_FORMATS = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}


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


class AttentionOps:
    """The KV and attention ops of ``CudaOps`` (its ``cuda``, ``is_simulator``, ``alloc``, ``upload``,
    ``_owning``, ``_track``, ``_stream``, ``_num_sms``, ``_rope``, ``placeholders``, ``is_copy_overlapped``
    and the host tier's ``_kv_fills`` and ``_tier_launch``)."""

    def kv_cache(self, owner, num_layers, num_cells, num_kv_heads, head_dim, kv_type, resident_cells: int = 0,
                 staging_owner: str = "") -> CudaKv:
        """resident_cells (0: every cell) of each layer on the device; the other cells, with a host tier,
        in mapped host memory, and two staging layers of every cell charged to ``staging_owner``."""
        from strata.gpu.kernels.kvcache import empty_kv_layer

        fmt, width = KV_FORMATS[kv_type], num_kv_heads * head_dim
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

    def prefill_kv_scratch_bytes_per_cell(self, head_dim: int, kv_width: int, kv_type: str) -> int:
        from strata.gpu.kernels import tensor_core

        return kv_scratch_bytes_per_cell(head_dim, kv_width, kv_type,
                                         has_tensor_cores=self.is_simulator or tensor_core.is_available())


def kv_scratch_bytes_per_cell(head_dim: int, kv_width: int, kv_type: str, *, has_tensor_cores: bool) -> int:
    """The F16 copy (K and V) a quantized cache layer is dequantized into for tensor-core prefill
    attention (``attention`` above), per cell; 0 where that kernel does not run."""
    from strata.gpu.kernels.attention_mma import is_supported

    fmt = KV_FORMATS[kv_type]
    return 4 * kv_width if fmt != "F16" and has_tensor_cores and is_supported(head_dim, fmt) else 0

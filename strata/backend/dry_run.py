"""Ops that charge the ledger as a real load would and allocate nothing: ``strata check``'s backend."""

from __future__ import annotations

import logging

import numpy as np

from strata.backend.numpy_ops import NumpyArena, NumpyKv, NumpyOps
from strata.backend.ops import KV_STAGING_LAYERS, ExpertLayout
from strata.gpu.ledger import VramLedger

log = logging.getLogger(__name__)


class DryRunOps(NumpyOps):
    """Charges the ledger exactly as a load on ``backend`` would and allocates nothing: for ``strata check``."""

    name = "dry-run"

    def __init__(self, ledger: VramLedger, backend: str = "numpy", device: int = 0):
        super().__init__(ledger)
        self.backend = backend
        self.device = device

    def prepare_weights(self, weights) -> None:
        pass  # nothing is allocated, nothing to ready

    def probe_host_to_device(self) -> list[tuple[int, float]] | None:
        """The GPU's own copy rate where the dry run plans for one that is here (nothing is charged:
        the buffers live for the probe alone); else None."""
        from strata.backend.select import has_cuda_device

        if self.backend != "cuda" or not has_cuda_device():
            return None
        from strata.gpu.pcie_probe import probe_host_to_device

        try:
            return probe_host_to_device(device=self.device)
        except Exception as exc:  # a busy or partitioned device, a driver without events: the rate is assumed
            log.warning("the PCIe probe failed (%s: %s); the plan assumes the rate", type(exc).__name__, exc)
            return None

    @property
    def is_kv_staged(self) -> bool:
        return self.backend != "numpy"

    def prefill_kv_scratch_bytes_per_cell(self, head_dim: int, kv_width: int, kv_type: str) -> int:
        if self.backend == "numpy":
            return 0
        from strata.backend.cuda_attention_ops import kv_scratch_bytes_per_cell

        return kv_scratch_bytes_per_cell(head_dim, kv_width, kv_type, has_tensor_cores=True)

    def prefill_weight_scratch_bytes(self, model, num_layers: int) -> int:
        if self.backend == "numpy":
            return 0
        from strata.backend.cuda_ops import weight_scratch_bytes

        return weight_scratch_bytes(model, num_layers, has_tensor_cores=True)

    def expert_layout(self, model, is_mtp: bool = False) -> ExpertLayout:
        if self.backend == "numpy":
            return super().expert_layout(model, is_mtp)
        from strata.backend.layouts import packed_expert_layout

        return packed_expert_layout(model, is_mtp)

    def alloc(self, owner: str, shape, dtype) -> np.ndarray:
        return self._track_placeholder(owner, int(np.prod(shape)) * np.dtype(dtype).itemsize)

    def upload(self, owner: str, host: np.ndarray) -> np.ndarray:
        return self._track_placeholder(owner, host.nbytes)

    def arena(self, owner: str, reserved_bytes: int, segment_bytes: int, layout: ExpertLayout):
        if self.backend == "numpy":
            return NumpyArena(self.ledger, owner, reserved_bytes, segment_bytes, layout, is_backed=False)
        from strata.backend.expert_arena import CountingRange, PlaneArena

        return PlaneArena(self.ledger, owner, reserved_bytes, segment_bytes, layout, granularity=2 << 20,
                          make_range=CountingRange)

    def stage_experts(self, storage, slots, hosts, is_after_compute: bool = True) -> None:
        pass  # nothing is allocated, so nothing is copied

    def kv_cache(self, owner, num_layers, num_cells, num_kv_heads, head_dim, kv_type, resident_cells: int = 0,
                 staging_owner: str = ""):
        cell_bytes = NumpyKv(1, 1, num_kv_heads, head_dim, kv_type).data.nbytes  # K and V of one layer
        resident_cells = resident_cells or num_cells
        if resident_cells < num_cells and self.is_kv_staged:  # the layers a tiered cache is read through
            self._track_placeholder(staging_owner, KV_STAGING_LAYERS * cell_bytes * num_cells)
        return self._track_placeholder(owner, cell_bytes * num_layers * resident_cells)

    def _track_placeholder(self, owner: str, num_bytes: int) -> np.ndarray:
        placeholder = np.empty(0, dtype=np.uint8)
        self._charges[id(placeholder)] = (placeholder, self.ledger.charge(owner, num_bytes))
        return placeholder

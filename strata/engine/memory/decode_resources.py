"""The engine's decode-only resources: what a loan may release during prefill.

``output_head`` (the native head, re-uploaded from a host copy in the backend's layout),
``mtp_draft_head`` (the MTP block's dense tensors), ``mtp_experts`` (its routed experts, every one in
a slot of an arena of their own, as the MoE kernels read the cache's), and the ``verifier`` arena
(scratch for checking speculated tokens). Each charges the ledger under its own
name while resident; release and restore are atomic.
"""

from __future__ import annotations

import numpy as np

from strata.backend.ops import ExpertLayout, Ops, QTensor
from strata.engine.memory.expert_pack import pack_layer
from strata.model import quants
from strata.model.gguf_file import GgufModel, TensorRef


class TensorsResource:
    """Weights uploaded from host copies; ``tensors[name]`` is a QTensor while resident (a norm's
    vector, a 1-D source, is float32 on the backend, as ``DeviceWeights.vectors``)."""

    def __init__(self, name: str, ops: Ops, sources: dict[str, TensorRef], is_reloaded: bool = False):
        self.name = name
        self.ops = ops
        self.sources = sources
        self.num_bytes = sum(ref.nbytes for ref in sources.values())
        self.tensors: dict[str, QTensor] | None = None
        # is_reloaded (a loan may release it): keep host copies in the backend's layout, packed once
        # (packing a 150 MB head takes ~0.4 s), for every later restore
        self.is_reloaded = is_reloaded
        self._encoded: dict[str, QTensor] | None = None

    @property
    def is_resident(self) -> bool:
        return self.tensors is not None

    def release(self) -> None:
        if self.tensors is None:
            return
        for tensor in self.tensors.values():
            self.ops.free(_device_array(tensor))
        self.tensors = None

    def encode_host_copies(self) -> None:
        """Pack the host copies a reloaded resource restores from, now (at load), rather than inside
        the first request that restores it: a startup loan's first restore comes at the end of
        the first prefill, and packing the 30B model's head and MTP block took ~0.5 s there. The
        copies are page-locked where the backend can: every restore (about 500 MiB for that model's
        loan) then uploads at the pinned PCIe rate."""
        if self.is_reloaded and self._encoded is None:
            self._encoded = {key: self.ops.pinned(host) if isinstance(host, QTensor) else host
                             for key, host in self._encode().items()}

    def _encode(self) -> dict[str, QTensor | np.ndarray]:
        return {key: _vector(ref) if len(ref.shape) == 1 else self.ops.encode_qtensor(ref.data, ref.qtype, ref.shape)
                for key, ref in self.sources.items()}

    def restore(self) -> None:
        if self.tensors is not None:
            return
        encoded = self._encoded
        if encoded is None:
            encoded = self._encode()
            if self.is_reloaded:
                self._encoded = encoded
        uploaded: dict[str, QTensor] = {}
        try:
            for key, host in encoded.items():
                uploaded[key] = self.ops.upload_encoded(self.name, host) if isinstance(host, QTensor) else \
                    self.ops.upload(self.name, host)
        except BaseException:
            for tensor in uploaded.values():
                self.ops.free(_device_array(tensor))
            raise
        self.tensors = uploaded


class ExpertsResource:
    """One layer's routed experts, all resident: expert ``e`` in slot ``e`` of an arena of their own
    (``storage``), so ``ops.moe`` reads them through ``slot_table`` as it reads the cache's. The packed
    slots stay in host memory (page-locked where the backend can) for every restore."""

    def __init__(self, name: str, ops: Ops, model: GgufModel, layer: int, layout: ExpertLayout):
        self.name = name
        self.ops = ops
        self.layout = layout.at_layer(layer)  # this layer's types, in ``layout``'s slot geometry
        self.num_experts = model.spec.num_experts
        self._model, self._layer = model, layer
        self._host: np.ndarray | None = None  # [N, slot_bytes], packed at the first restore
        num_bytes = self.num_experts * layout.slot_bytes
        self.storage = ops.arena(name, num_bytes, num_bytes, layout)  # address space only until restored
        self.num_bytes = self.storage.segment_bytes  # what mapping its one segment charges
        self.slot_table = np.arange(self.num_experts, dtype=np.int32)  # [N] expert e in slot e

    @property
    def is_resident(self) -> bool:
        return self.storage.mapped_bytes > 0

    def release(self) -> None:
        self.storage.unmap_to(0)

    def encode_host_copies(self) -> None:
        """Pack the experts into host memory now (at load), not in the first restore."""
        if self._host is None:
            host = self.ops.host_buffer(self.num_experts * self.layout.slot_bytes)
            self._host = host.reshape(self.num_experts, self.layout.slot_bytes)
            pack_layer(self._model, self._layer, self.layout, self._host, self.ops.encode_experts)

    def restore(self) -> None:
        if self.is_resident:
            return
        self.encode_host_copies()
        self.storage.map_segments(self.storage.segment_bytes)
        try:
            ticket = self.ops.stage_experts(self.storage, list(range(self.num_experts)), list(self._host))
            # the kernels' stream waits for the copies, the host does not: the loan's put-back and
            # checks run while they land (324 MiB, ~6 ms at 55 GB/s, for the 30B model's block)
            self.ops.wait_staged(ticket)
        except BaseException:
            self.storage.unmap_to(0)
            raise


class ArenaResource:
    """A scratch arena of fixed size (the speculative verifier's), re-created on restore."""

    def __init__(self, name: str, ops: Ops, num_bytes: int):
        self.name = name
        self.ops = ops
        self.num_bytes = num_bytes
        self.buffer = None

    @property
    def is_resident(self) -> bool:
        return self.buffer is not None

    def release(self) -> None:
        if self.buffer is not None:
            self.ops.free(self.buffer)
            self.buffer = None

    def restore(self) -> None:
        if self.buffer is None:
            self.buffer = self.ops.alloc(self.name, (self.num_bytes,), np.uint8)


def _vector(ref: TensorRef) -> np.ndarray:
    return quants.dequantize(ref.data, ref.qtype, ref.shape).astype(np.float32).reshape(-1)


def _device_array(tensor):
    return tensor.data if isinstance(tensor, QTensor) else tensor


def upload_tensor(ops: Ops, owner: str, ref: TensorRef) -> QTensor:
    """A weight in the backend's own layout, uploaded from the file's bytes."""
    return ops.upload_qtensor(owner, ref.data, ref.qtype, ref.shape)

"""The engine's decode-only resources: what a loan may release during prefill.

``output_head`` (the native head, re-uploaded from a host copy in the backend's layout),
``mtp_draft_head`` and ``mtp_experts`` (the MTP block's dense and routed tensors), and the
``verifier`` arena (scratch for checking speculated tokens). Each charges the ledger under its own
name while resident; release and restore are atomic.
"""

from __future__ import annotations

import numpy as np

from strata.backend.ops import Ops, QTensor
from strata.model.gguf_file import TensorRef


class TensorsResource:
    """Weights uploaded from host copies; ``tensors[name]`` is a QTensor while resident."""

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
            self.ops.free(tensor.data)
        self.tensors = None

    def encode_host_copies(self) -> None:
        """Pack the host copies a reloaded resource restores from, now (at load), rather than inside
        the first request that restores it: a startup loan's first restore comes at the end of
        the first prefill, and packing the 30B model's head and MTP block took ~0.5 s there. The
        copies are page-locked where the backend can: every restore (507.6 MiB for that model's
        loan) then uploads at the pinned PCIe rate."""
        if self.is_reloaded and self._encoded is None:
            self._encoded = {key: self.ops.pinned(host) for key, host in self._encode().items()}

    def _encode(self) -> dict[str, QTensor]:
        return {key: self.ops.encode_qtensor(ref.data, ref.qtype, ref.shape) for key, ref in self.sources.items()}

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
                uploaded[key] = self.ops.upload_encoded(self.name, host)
        except BaseException:
            for tensor in uploaded.values():
                self.ops.free(tensor.data)
            raise
        self.tensors = uploaded


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


def upload_tensor(ops: Ops, owner: str, ref: TensorRef) -> QTensor:
    """A weight in the backend's own layout, uploaded from the file's bytes."""
    return ops.upload_qtensor(owner, ref.data, ref.qtype, ref.shape)

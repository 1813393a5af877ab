"""The ``verifier`` arena: what a speculation step on the device reads and writes besides the model.

One buffer, placed as a loan resource (``ArenaResource``): released while a loan holds it during
prefill, allocated again before decode. A request's ``DeviceSpeculation`` carves it into

    h_in [R, D] float32    the verified rows the first draft step reads
    x_c [1, D] float32     the draft chain's state
    logits [R, V] float32  the verify step's logits, one row per verified position
    drafts, targets [R] int32;  tok_c [1] int32;  record [R + 1] int32: a verify step's acceptance
    inputs [4R + 3] int32  what a draft reads, written by the host in one copy or by a verify step's
                           acceptance on the device: tok_in [R], pos_in [R], the chain's pos_c, place_c
                           and row_c [1] each, and the draft oracle's window [2R] (views of it)

R = 1 + spec_depth rows. Each part starts on a 256-byte boundary (the device allocator's, so that
the kernels' 16-byte loads stay aligned); the views of ``inputs`` are int32 slices of it, read one id at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from strata.errors import EngineError

_ALIGN = 256


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


class VerifierLayout(NamedTuple):
    hidden_size: int
    vocab_size: int
    max_rows: int

    def parts(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Each part's (shape, dtype), in the arena's order."""
        rows, width = self.max_rows, self.hidden_size
        return {"h_in": ((rows, width), np.float32), "x_c": ((1, width), np.float32),
                "logits": ((rows, self.vocab_size), np.float32), "drafts": ((rows,), np.int32),
                "targets": ((rows,), np.int32), "tok_c": ((1,), np.int32), "record": ((rows + 1,), np.int32),
                "inputs": ((4 * rows + 3,), np.int32)}

    @property
    def num_bytes(self) -> int:
        return sum(_aligned(int(np.prod(shape)) * np.dtype(dtype).itemsize) for shape, dtype in self.parts().values())

    def carve(self, buffer) -> dict[str, Any]:
        """Views of ``buffer`` (a uint8 device or host array of at least ``num_bytes``) by part name, and
        of ``inputs`` by the names of its parts."""
        if buffer.shape[0] < self.num_bytes:
            raise EngineError(f"the verifier arena holds {buffer.shape[0]} bytes, its parts need {self.num_bytes}")
        views, offset = {}, 0
        for name, (shape, dtype) in self.parts().items():
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            views[name] = buffer[offset:offset + size].view(dtype).reshape(shape)
            offset += _aligned(size)
        rows, inputs = self.max_rows, views["inputs"]
        chain = 2 * rows  # where pos_c, place_c and row_c follow tok_in and pos_in
        views.update(tok_in=inputs[:rows], pos_in=inputs[rows:chain], chain=inputs[chain:chain + 3],
                     pos_c=inputs[chain:chain + 1], place_c=inputs[chain + 1:chain + 2],
                     row_c=inputs[chain + 2:chain + 3], window=inputs[chain + 3:])
        return views

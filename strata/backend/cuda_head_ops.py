"""The cuda backend's output head (``CudaOps`` takes it from ``HeadOps``): logits of the last row or of
a verify step's rows, greedy picks on the device with the logit bias, and the small device-side steps of
device decode (increment, a draft chain's step and a verify step's acceptance, the pinned readback)."""

from __future__ import annotations

import numpy as np

from strata.backend.ops import DECODE_MAX_ROWS, QTensor
from strata.gpu import driver_calls
from strata.gpu.ledger import ACTIVATIONS_OWNER as ACTIVATIONS


class HeadOps:
    """The head ops of ``CudaOps`` (its ``cuda``, ``_owning``, ``_stream``, ``is_simulator`` and
    ``host_buffer``)."""

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

    def take_draft(self, token, window, place, row, drafts) -> None:
        """token [1] = window[row + place] where that is >= 0 (the bench's draft oracle), drafts[place] = token,
        place += 1: a draft chain's step, on the device (``kernels/drafts.py``)."""
        from strata.gpu.kernels.drafts import take_draft

        take_draft(token, window, place, row, drafts, stream=self._stream)

    def spread_inputs(self, inputs, wide_inputs) -> None:
        """A one-row step's token and position (inputs [2]) as the first token and the positions of a step of R
        rows (wide_inputs [2R]), on the device (``kernels/drafts.py``)."""
        from strata.gpu.kernels.drafts import spread_inputs

        spread_inputs(inputs, wide_inputs, stream=self._stream)

    def take_row(self, x, row, out) -> None:
        """out [1, D] = x [R, D] at row row[0] (device int32 [1])."""
        from strata.gpu.kernels.drafts import take_row

        take_row(x, row, out, stream=self._stream)

    def accept_drafts(self, drafts, targets, depth: int, vocab_size: int, step_inputs, draft_inputs, chain,
                      record) -> None:
        """A greedy verify step's acceptance on the device and the next step's inputs from it
        (``kernels/drafts.py``)."""
        from strata.gpu.kernels.drafts import accept_drafts

        accept_drafts(drafts, targets, depth, vocab_size, step_inputs, draft_inputs, chain, record,
                      stream=self._stream)

    def readback(self):
        """A ``Readback`` (``strata/gpu/readback.py``): token ids and small arrays back through pinned memory."""
        from strata.gpu.readback import PINNED_BYTES, Readback

        calls = None if self.is_simulator else driver_calls.load()
        return Readback(self.host_buffer(PINNED_BYTES) if calls else None, calls)

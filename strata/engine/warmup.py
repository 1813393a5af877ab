"""The warm-up that ends a load on the GPU backends: every kernel a request uses is compiled (or loaded from
the kernel cache) before the first request, and the engine is left as it was.

A tiny prefill through the staging ring (once per MoE tile shape the backend picks between), chunks of
each of decode's row counts after it (the MTP block's too), and its logits, one decode step, a draft and
a verify step at every depth where speculation runs on the device, the launches of a fully cached
model's decode token and the greedy tail (head, bias, argmax). Resources a startup loan holds back come
back for the warm-up alone where they fit. Then the KV tokens are cleared, the expert cache is emptied
and the ledger is checked against its state before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time

import numpy as np

from strata.backend.ops import DECODE_MAX_ROWS
from strata.engine.stream_stats import StreamStats
from strata.errors import AllocationError
from strata.gpu import live_allocations
from strata.gpu.ledger import ACTIVATIONS_OWNER
from strata.hooktypes import MTP_DRAFT_HEAD, MTP_EXPERTS, OUTPUT_HEAD, VERIFIER

WARMUP_HEAD_ROWS = 256  # rows of a held-back head that the warm-up's logits kernel reads
WARMUP_MIN_TOKENS = 24  # above decode's row kernels (DECODE_MAX_ROWS) and block routing's 16: prefill's kernels run
log = logging.getLogger("strata.engine")


def warm_up(engine) -> float:
    """Compile every kernel a request uses on ``engine`` (an ``Engine``) and reset its state; returns the
    seconds it took."""
    started = time.perf_counter()
    before = dict(engine.ledger.snapshot().by_owner)
    charges_before = {c.charge_id for c in engine.ledger.live_charges(ACTIVATIONS_OWNER)}
    geometry = _geometry(engine)
    num_tokens = geometry.chunk_tokens if geometry else WARMUP_MIN_TOKENS
    tokens = np.arange(3, 3 + num_tokens, dtype=np.int64) % engine.spec.vocab_size
    stats = StreamStats()
    layout = engine.cache.layout if engine.cache else None
    try:
        if geometry:
            engine.workspace.allocate(geometry)
        try:
            for tile_rows in engine.ops.moe_tile_rows(layout):  # the MoE kernels of every tile a chunk may take
                with engine.ops.forcing_moe_tile_rows(tile_rows):
                    hidden = engine.runner.forward(tokens, 0, engine.workspace if geometry else None, stats)
            if engine.mtp is not None and engine.mtp.can_cache_prompt:  # the MTP block's KV of the prompt (no MoE)
                engine.mtp.cache_prompt(hidden[:num_tokens - 1], tokens[1:], 0)
            _prefill_rows(engine, tokens, num_tokens, stats)
            if _is_mtp_resident(engine):
                _mtp_rows(engine, hidden, tokens, num_tokens)
        finally:
            engine.ops.synchronize()  # no copy may still target the ring when the workspace goes
            engine.workspace.free()
        if engine.mtp is not None and not _is_mtp_resident(engine) and engine.backend == "cuda":
            _deferred_mtp_prefill(engine, hidden, tokens)  # only the GPU compiles
        token = int(np.argmax(_logits(engine, hidden)))
        # decode attention's launch does not depend on the position (its splits are sized for
        # the whole cache), so one step compiles every decode kernel
        hidden = engine.runner.forward(np.array([token]), num_tokens, None, stats)
        _logits(engine, hidden)
        if engine.mtp is not None:  # a draft step and a verify step of two rows
            _speculation(engine, hidden, token, num_tokens, stats)
        if engine.runner.decode_step is not None:  # the whole-token graphs of a fully cached model
            engine.runner.decode_step.compile_resident(token, num_tokens + 1)
            if engine.config.runtime.greedy_on_device:  # the head, bias and argmax of a greedy step
                _compile_greedy(engine)
        engine.ops.synchronize()
        del hidden
    finally:
        engine.runner.reset_decode()
        engine.kv_tokens = []
        if engine.cache:
            engine.cache.clear()
        gc.collect()  # the temporaries of the warm-up go, and with them their charges
        engine.ops.trim_memory()
    after = dict(engine.ledger.snapshot().by_owner)
    seconds = time.perf_counter() - started
    if {k: v for k, v in after.items() if v} != {k: v for k, v in before.items() if v}:
        log.warning("warm-up left the ledger at %s (before: %s)", after, before)
        if after.get(ACTIVATIONS_OWNER, 0) > before.get(ACTIVATIONS_OWNER, 0) and engine.backend == "cuda":
            # the warm-up's own charges still live, and numba-cuda's pointers to them: who holds them
            charges = [c for c in engine.ledger.live_charges(ACTIVATIONS_OWNER) if c.charge_id not in charges_before]
            log.warning("warm-up's leftover activations: %d allocation(s) of %s bytes", len(charges),
                        ", ".join(str(c.num_bytes) for c in charges[:16]))
            for line in live_allocations.holders([c.charge_id for c in charges]):
                log.warning("warm-up's leftover held by: %s", line)
    log.info("warm-up: %d-token prefill (for %d MoE tile shape(s)) and one decode step in %.2f s (%d "
             "compilations, %.2f s; %d kernels loaded from the kernel cache; state reset)", num_tokens,
             len(engine.ops.moe_tile_rows(layout)), seconds, engine.compiles.tally.num_compiles,
             engine.compiles.tally.seconds, engine.compiles.tally.num_loaded)
    return seconds


def _deferred_mtp_prefill(engine, hidden, tokens: np.ndarray) -> None:
    """The MTP block's pass over a prefill chunk (where a loan holds what it reads) and over a few rows while a
    startup loan holds the block back: its resources come back for the warm-up alone and go again. Otherwise the
    first request that runs them with the block resident (the first without a loan) compiles them inside it."""
    with deferred_restored(engine, (MTP_DRAFT_HEAD, MTP_EXPERTS), "the MTP block's prefill launches") as is_here:
        if not is_here:
            return
        if engine.mtp.prompt_weights is None:  # else the pass ran with the main layers' chunk above
            engine.mtp.cache_prompt(hidden[:len(tokens) - 1], tokens[1:], 0)
        _mtp_rows(engine, hidden, tokens, len(tokens))
        engine.ops.synchronize()


def _prefill_rows(engine, tokens: np.ndarray, position: int, stats: StreamStats) -> None:
    """Prefill chunks of up to ``DECODE_MAX_ROWS`` tokens at ``position`` (a prompt's last few tokens,
    or the unread end of a cached prefix). Such a chunk runs decode's row kernels (its routing apart: the
    norm, router GEMV and top-k of an uncaptured forward), compiled for each row count, with the staging
    ring's slot table: neither the full chunk nor a decode step reaches them."""
    for num_rows in _row_counts(engine, engine.context_tokens - 2 - position):
        engine.runner.forward(tokens[:num_rows], position, engine.workspace, stats)


def _mtp_rows(engine, hidden, tokens: np.ndarray, position: int) -> None:
    """The whole MTP block over 1 to ``DECODE_MAX_ROWS`` rows of ``hidden`` at ``position`` (a speculation step's
    verified rows and drafts)."""
    for num_rows in _row_counts(engine, min(len(tokens) - 1, engine.context_tokens - 2 - position)):
        engine.mtp.hidden(hidden[:num_rows], tokens[1:num_rows + 1], position)


def _row_counts(engine, max_rows: int) -> range:
    """1 to ``DECODE_MAX_ROWS`` rows (at most ``max_rows``) on the GPU. Other backends compile nothing:
    there one count, two rows, runs the path (a chunk of nine rows takes minutes in the simulator)."""
    max_rows = min(DECODE_MAX_ROWS, max_rows)
    if engine.backend == "cuda":
        return range(1, max_rows + 1)
    num_rows = min(2, max_rows)
    return range(num_rows, num_rows + 1) if num_rows >= 1 else range(0)


@contextlib.contextmanager
def deferred_restored(engine, names: tuple[str, ...], what: str):
    """Yield True with the deferred resources among ``names`` restored (released again after),
    or False, with a warning, when they do not fit now."""
    deferred = [r for r in (engine.resources.get(name) for name in names) if r is not None and not r.is_resident]
    try:
        for resource in deferred:
            resource.restore()
    except AllocationError as exc:
        for resource in deferred:
            resource.release()
        log.warning("warm-up: %s not compiled (the startup loan's deferred resources do not fit now: %s); the "
                    "first request that needs them compiles them", what, exc)
        yield False
        return
    try:
        yield True
    finally:
        for resource in deferred:
            resource.release()


def _speculation(engine, hidden, token: int, position: int, stats: StreamStats) -> None:
    """Compile the MTP block's launches and a verify step's (a forward of two rows), where a
    startup loan does not hold the block back; with greedy decode on the device, a draft and a
    verify step at every depth (each row count compiles its own launches, ~0.3 s each, which a
    request's first step at that depth would otherwise pay inside its decode time)."""
    head = engine.resources.get("output_head")
    is_head_here = head is None or head.is_resident
    if _is_mtp_resident(engine):
        drafted = engine.mtp.hidden(hidden, np.array([token]), position)
        if is_head_here:
            engine.mtp.logits(drafted)
    engine.runner.forward(np.array([token, token]), position + 1, None, stats)
    device = engine.runner.speculation
    if engine.mtp is None or device is None or engine.ops.is_simulator:  # the simulator compiles nothing
        return
    # a startup loan defers some of them (loan_head, loan_mtp): they come back for the warm-up alone,
    # before the expert cache fills, and go again after it
    with deferred_restored(engine, (VERIFIER, OUTPUT_HEAD, MTP_DRAFT_HEAD, MTP_EXPERTS),
                           "speculation's steps") as is_here:
        if not is_here:
            return
        max_rows, ops = engine.config.runtime.spec_depth + 1, engine.ops
        owned = []
        try:
            # the picks' launches (with a bias, into the logits' buffer), compiled before a verify captures them
            owned += [ops.upload(ACTIVATIONS_OWNER, np.zeros((max_rows, engine.spec.hidden_size), np.float32)),
                      ops.alloc(ACTIVATIONS_OWNER, (max_rows,), np.int32),
                      ops.alloc(ACTIVATIONS_OWNER, (max_rows, engine.spec.vocab_size), np.float32),
                      ops.upload(ACTIVATIONS_OWNER, np.zeros(1, np.int32)),
                      ops.upload(ACTIVATIONS_OWNER, np.zeros(1, np.float32))]
            rows, picks, logits, *bias = owned
            for num_rows in range(1, max_rows + 1):
                ops.greedy_rows(rows[:num_rows], *engine.output_head(), tuple(bias), picks[:num_rows],
                                logits=logits[:num_rows])
            for depth in range(1, max_rows):
                device.draft(hidden, [token], position, depth)
                device.verify(token, position + 1, depth, engine.output_head(), None, stats)
        finally:
            device.reset()
            ops.synchronize()
            for array in owned:
                ops.free(array)


def _is_mtp_resident(engine) -> bool:
    """Whether speculation's MTP block is loaded and resident (a startup loan may hold it back)."""
    return engine.mtp is not None and engine.mtp.is_resident


def _logits(engine, hidden) -> np.ndarray:
    """The head's logits (``_head``)."""
    with _head(engine) as head_tensor:
        return engine.ops.logits(hidden, engine.weights.vectors["output_norm"], head_tensor, engine.spec.rms_norm_eps)


def _compile_greedy(engine) -> None:
    """The greedy tail's kernels over the head (``_head``). A function of its own: a ``with ... as``
    name outlives its block, and the warm-up's ledger check would find the held-back head's slice alive."""
    with _head(engine) as head_tensor:
        engine.runner.decode_step.compile_greedy(
            (engine.weights.vectors["output_norm"], head_tensor, engine.spec.rms_norm_eps))


@contextlib.contextmanager
def _head(engine):
    """The output head; while a startup loan holds the native head back, a slice of it uploaded
    for the call (the same kernels run on it)."""
    head = engine.resources.get("output_head")
    if head is None or head.is_resident:
        yield engine.output_head()[1]
        return
    ref = head.sources["output"]
    num_rows = min(WARMUP_HEAD_ROWS, int(np.prod(ref.shape[:-1])))
    raw = ref.data.reshape(int(np.prod(ref.shape[:-1])), -1)[:num_rows]
    tensor = engine.ops.upload_qtensor(ACTIVATIONS_OWNER, raw, ref.qtype, (num_rows, ref.shape[-1]))
    try:
        yield tensor
    finally:
        engine.ops.free(tensor.data)


def _geometry(engine):
    """The startup ring with a chunk just big enough for the prefill MoE path to stream every expert."""
    startup = engine.loan.startup_geometry
    if startup is None or engine.cache is None:
        return None
    spec = engine.spec
    wanted = max(WARMUP_MIN_TOKENS, -(-spec.num_experts // max(1, spec.num_experts_used)))
    num_tokens = max(1, min(wanted, startup.chunk_tokens, engine.context_tokens - 2))
    return dataclasses.replace(startup, chunk_tokens=num_tokens)

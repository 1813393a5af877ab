"""The parts ``Engine.load`` assembles that need more than a constructor call: the VRAM budget, the
decode-only resources the loan may lend, the host expert pack, and the checks on what placement left."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from strata.backend.layouts import EXPERT_MATRICES
from strata.backend.ops import ExpertLayout, Ops
from strata.backend.select import require_runnable
from strata.config import Config
from strata.engine.loan.resources import Resource
from strata.engine.memory.decode_resources import ArenaResource, ExpertsResource, TensorsResource
from strata.engine.memory.expert_cache import ExpertCache
from strata.engine.memory.expert_pack import ExpertPack
from strata.engine.planning.placement import Placement
from strata.engine.planning.planner import CacheState
from strata.engine.planning.rates import PrefillRates, probed_pcie
from strata.errors import ConfigError
from strata.gpu.lock import default_lock_dir, hold_device_lock
from strata.hooktypes import MTP_DRAFT_HEAD, MTP_EXPERTS, OUTPUT_HEAD, VERIFIER
from strata.model.gguf_file import GgufModel, check_finite
from strata.model.spec import ModelSpec

NUMPY_HEADROOM_BYTES = 1 << 30  # the numpy backend's default budget: the model file plus this
log = logging.getLogger("strata.engine")
# the MTP block's tensors its pass over a prompt reads (MtpDraft.cache_prompt: its input, keys and values)
MTP_PROMPT_TENSORS = ("nextn.enorm", "nextn.hnorm", "nextn.eh_proj", "attn_norm", "attn_q", "attn_k", "attn_v",
                      "attn_q_norm", "attn_k_norm")
MTP_PROMPT_OWNER = "mtp_prompt_weights"


def claim_loan_device(config: Config, backend: str) -> Path | None:
    """Hold the one-loan-taker lock of this process's GPU when its configuration can take loans
    (``loan.enabled``) on a GPU; ``DeviceLockError`` naming the holder when another process has it.
    The cudasim and numpy backends share no GPU: they lock only a stand-in ``runtime.device_identity``.
    Returns the lock file, or None when this process takes no lock."""
    rt = config.runtime
    if not config.loan.enabled or not (backend == "cuda" or rt.device_identity):
        return None
    identity = rt.device_identity
    if not identity:
        from strata.gpu.device import device_uuid

        require_runnable(backend, rt.device)
        identity = device_uuid(rt.device)
    fix = ("stop that process, run this one on another GPU (runtime.device), or set loan.enabled = false in one "
           "of them")
    return hold_device_lock(identity, rt.lock_dir or default_lock_dir(), fix)


def check_cache_maps_a_segment(config: Config, placement: Placement, cache: ExpertCache) -> None:
    """The staging ring lives in the expert cache, so a cache of no slot cannot prefill. A segment
    costs more than runtime.vmm_segment where each plane of the packed experts is rounded up to
    the device's mapping granularity."""
    if cache.num_slots:
        return
    short_mib = (cache.segment_bytes - placement.cache_base_bytes) / 2**20
    raise ConfigError(
        f"a VRAM budget of {placement.budget_bytes / 2**20:.0f} MiB (runtime.vram_budget) leaves "
        f"{placement.cache_base_bytes / 2**20:.0f} MiB for the expert cache, less than one of its segments "
        f"({cache.segment_bytes / 2**20:.0f} MiB: runtime.vmm_segment of expert slots, each plane rounded up to "
        f"the device's mapping granularity), and prefill stages experts in cache slots; raise "
        f"runtime.vram_budget by at least {short_mib:.0f} MiB")


def min_cache_slots(config: Config, base_slots: int, spec: ModelSpec) -> int:
    """Slots the prompt workspace may never borrow: a share of the startup cache (leaving the smallest
    staging ring borrowable), and at least one token's experts, which decode needs together."""
    keep = int(base_slots * config.planner.cache_keep_share)
    return max(spec.num_experts_used, min(keep, base_slots - config.planner.min_ring_slots))


def budget_bytes(config: Config, backend: str, model: GgufModel) -> int:
    """``runtime.vram_budget``; unset, the model file plus headroom on numpy, 90% of the free VRAM on a GPU."""
    if config.runtime.vram_budget_bytes:
        return config.runtime.vram_budget_bytes
    if backend == "numpy":
        return model.path.stat().st_size + NUMPY_HEADROOM_BYTES
    from strata.gpu.device import free_device_bytes

    require_runnable(backend, config.runtime.device)  # the free memory is measured on the device
    return int(free_device_bytes(config.runtime.device) * 0.9)


def check_weights_finite(model: GgufModel) -> None:
    """Refuse a model whose weights hold NaN or infinity (``NonFiniteWeightError`` naming the tensor),
    reading only each block's float fields. The routed experts of the main layers are checked where
    they are packed (``ExpertPack.from_gguf``, at load or by ``strata pack``), not here: with an
    expert pack configured, the load never reads them from the GGUF."""
    spec = model.spec
    routed = {f"blk.{layer}.{name}.weight" for layer in range(spec.num_layers) for name in EXPERT_MATRICES} \
        if spec.is_moe else set()
    for name, ref in model.tensors.items():
        if name not in routed:
            check_finite(ref, model.path)


def check_mtp(config: Config, model: GgufModel) -> None:
    """``runtime.mtp`` needs the model's own MTP (nextn) block."""
    if config.runtime.mtp and not model.spec.num_nextn_layers:
        raise ConfigError(f"runtime.mtp = true, but {model.path.name} has no MTP block ({model.spec.arch}."
                          "nextn_predict_layers is 0): speculative decoding drafts with the model's own MTP "
                          "block; set runtime.mtp = false and runtime.spec_depth = 0, or use a GGUF with one")


def mtp_expert_layout(config: Config, model: GgufModel, ops: Ops) -> ExpertLayout | None:
    """The slots of the MTP block's routed experts (an arena of their own, not the cache's), where
    ``runtime.mtp`` runs a block that has some."""
    spec = model.spec
    names = [f"blk.{spec.num_layers}.{name}.weight" for name in EXPERT_MATRICES]
    if not (config.runtime.mtp and spec.num_nextn_layers and all(n in model.tensors for n in names)):
        return None
    return ops.expert_layout(model, is_mtp=True)


def decode_resources(config: Config, model: GgufModel, ops: Ops, placement: Placement,
                     mtp_layout: ExpertLayout | None) -> dict[str, Resource]:
    """The decode-only resources this model and configuration have, by name, none of them uploaded yet;
    ``mtp_layout``: the MTP experts' slots (``mtp_expert_layout``)."""
    spec, rt = model.spec, config.runtime
    check_mtp(config, model)
    resources = {}
    is_loaned = config.loan.enabled  # loaned weights keep a packed host copy for their restores
    if rt.mtp and rt.spec_depth:
        resources[VERIFIER] = ArenaResource(VERIFIER, ops, placement.verifier_bytes)
    if "output.weight" in model.tensors:
        resources[OUTPUT_HEAD] = TensorsResource(OUTPUT_HEAD, ops, {"output": model.tensors["output.weight"]},
                                                 is_loaned or rt.prefill_head_alias)
    if rt.mtp and spec.num_nextn_layers:
        prefix = f"blk.{spec.num_layers}."
        block = {n: r for n, r in model.tensors.items() if n.startswith(prefix)}
        experts = {n: r for n, r in block.items() if "_exps." in n}
        kept = mtp_prompt_sources(model)  # resident always: not the loan's
        resources[MTP_DRAFT_HEAD] = TensorsResource(
            MTP_DRAFT_HEAD, ops, {n: r for n, r in block.items() if n not in experts and n not in kept}, is_loaned)
        if experts and mtp_layout is not None:
            resources[MTP_EXPERTS] = ExpertsResource(MTP_EXPERTS, ops, model, spec.num_layers, mtp_layout)
    return resources


def mtp_prompt_sources(model: GgufModel) -> dict:
    """The first MTP block's tensors that writing its cache over a prompt reads (``MTP_PROMPT_TENSORS``), kept
    resident outside the loan's ``mtp_draft_head`` (a few MiB: its input projection and Q, K, V) so that a
    prompt prefilled under a loan still fills the block's cache and drafts attend over it; none where the block
    has an embedding table of its own (a vocabulary's rows: that stays the loan's, and so does the prompt pass)."""
    spec = model.spec
    if not spec.num_nextn_layers:
        return {}
    prefix = f"blk.{spec.num_layers}."
    if f"{prefix}nextn.embed_tokens.weight" in model.tensors:
        return {}
    names = (f"{prefix}{name}.weight" for name in MTP_PROMPT_TENSORS)
    return {name: model.tensors[name] for name in names if name in model.tensors}


def mtp_prompt_weights(config: Config, model: GgufModel, ops: Ops) -> TensorsResource | None:
    """``mtp_prompt_sources`` uploaded (resident for the engine's life), or None without speculation or them."""
    sources = mtp_prompt_sources(model) if config.runtime.mtp else {}
    if not sources:
        return None
    weights = TensorsResource(MTP_PROMPT_OWNER, ops, sources)
    weights.restore()
    return weights


def check_host_kv_fits(config: Config, placement: Placement) -> None:
    """The host tier of KV cells (``runtime.kv_resident_cells`` < ``runtime.context_tokens``) is
    pinned host memory for the engine's life, as the expert pack (``model.expert_pack``) is, which
    loads after it: refuse a tier that leaves the pack less than the host's available memory."""
    if not placement.host_kv_bytes:
        return
    pack = config.model.expert_pack
    pack_bytes = pack.stat().st_size if pack is not None and Path(pack).is_file() else 0
    available = available_host_bytes()
    if placement.host_kv_bytes + pack_bytes > available:
        rt = config.runtime
        with_pack = f" beside the {pack_bytes / 2**20:,.1f} MiB expert pack (model.expert_pack)" if pack_bytes else ""
        raise ConfigError(
            f"the KV cache's host tier ({rt.context_tokens - placement.kv_cells:,} cells of runtime.context_tokens = "
            f"{rt.context_tokens:,} past runtime.kv_resident_cells = {placement.kv_cells:,}, "
            f"{placement.host_kv_bytes / 2**20:,.1f} MiB of {rt.kv_type}) does not fit{with_pack} in the "
            f"{available / 2**20:,.1f} MiB of host memory available; raise runtime.kv_resident_cells, lower "
            "runtime.context_tokens or use a smaller runtime.kv_type")


def available_host_bytes() -> int:
    """Host memory available to new allocations (MemAvailable), or all of it where that is not reported."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def expert_pack(config: Config, model: GgufModel, ops: Ops, layout: ExpertLayout, show_progress: bool) -> ExpertPack:
    """The routed experts in host memory: read from ``model.expert_pack``, or packed from the GGUF now."""
    if config.model.expert_pack is not None:
        return ExpertPack.read(config.model.expert_pack, model, layout, ops.host_buffer)
    progress = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=model.spec.num_layers, desc="packing experts", unit="layer", file=sys.stderr)
        progress = lambda done: bar.update(done - bar.n)
    try:
        return ExpertPack.from_gguf(model, layout, ops.host_buffer, ops.encode_experts, progress)
    finally:
        if show_progress:
            bar.close()


def prefill_rates(config: Config, ops: Ops, backend: str) -> PrefillRates:
    """The cost model's rates: ``planner.pcie_bytes_per_s`` when configured, else the probe's (on a
    GPU; assumed elsewhere); the compute rate configured, or assumed until chunks calibrate it."""
    probe = None
    if not config.planner.pcie_bytes_per_s:
        started = time.perf_counter()
        samples = ops.probe_host_to_device()
        probe = probed_pcie(samples, backend, time.perf_counter() - started)
    rates = PrefillRates.from_config(config.planner, probe)
    log.info("prefill rates: %s", rates.describe())
    return rates


def cache_after_load(config: Config, cache: ExpertCache | None, spec: ModelSpec) -> CacheState | None:
    """What the expert cache holds once the load is done: with ``runtime.expert_preload`` every slot
    filled, up to the model's experts (the preload runs after the loan's start); else what it holds."""
    if cache is None:
        return None
    if not config.runtime.expert_preload:
        return CacheState(cache.num_slots, cache.num_cached)
    return CacheState(cache.num_slots, min(cache.num_slots, spec.num_layers * spec.num_experts))

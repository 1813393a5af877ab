"""The engine facade: load → generate, one request at a time. Serve and bench call only this.

``Engine.load`` opens the GGUF, loads and admits the loan plugins (startup fails here, before
anything is deferred or uploaded), places dense weights, KV cache and the expert cache under the
budget, packs the experts into host memory and starts the loan transaction. ``generate`` reuses
the KV prefix shared with the previous request, prefills only the unread tokens inside the loan
transaction, and decodes token by token. On the GPU backends ``load`` ends with a warm-up
(``warmup.py``) so that every kernel is compiled before the first request.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from strata.backend.dry_run import DryRunOps
from strata.backend.formats import require_runnable_tensors
from strata.backend.select import make_ops, select_backend
from strata.config import Config
from strata.engine import loading, warmup
from strata.engine.collector import freeze_loaded, thaw
from strata.engine.core import EngineCore
from strata.engine.decode.depth_policy import DepthPolicy
from strata.engine.decode.mtp import MtpDraft
from strata.engine.decode.speculative import DraftOracle
from strata.engine.generation import Generation
from strata.engine.loan.admission import admit
from strata.engine.loan.runtime_state import RuntimeSettings, RuntimeState
from strata.engine.loan.transaction import LoanTransaction
from strata.engine.memory.decode_resources import ExpertsResource, TensorsResource
from strata.engine.memory.expert_cache import CacheResidency, ExpertCache
from strata.engine.memory.expert_pack import ExpertPack
from strata.engine.memory.workspace import PromptWorkspace
from strata.engine.planning.placement import plan_placement
from strata.engine.planning.planner import Planner, largest_ring_slots
from strata.engine.planning.prefill_cost import PrefillCostModel
from strata.engine.runner import DeviceWeights, ModelRunner
from strata.engine.sampling import SamplingParams
from strata.errors import AllocationError
from strata.gpu.ledger import DECODE_GRAPHS_OWNER, LedgerSnapshot, VramLedger
from strata.hooktypes import MTP_DRAFT_HEAD, MTP_EXPERTS, OUTPUT_HEAD, VERIFIER
from strata.model.gguf_file import open_gguf
from strata.model.locate import resolve_model_path
from strata.model.tokenizer import Tokenizer
from strata.plugins import load_plugins

MTP_KV_OWNER = "mtp_kv"  # the MTP block's own KV cache (placement's mtp_kv)
KV_STAGING_OWNER = "kv_staging"  # the layers a host tier of KV cells is read through (placement's kv_staging)
log = logging.getLogger("strata.engine")


@dataclasses.dataclass(eq=False)
class Engine(EngineCore):
    """A loaded engine: ``load`` builds it, ``generate`` serves one request at a time.

    :ivar kept_decode_bytes: what decode's segments kept across requests hold (``prepare_decode``).
    """

    kept_decode_bytes: int = 0

    @property
    def idle_ledger(self) -> LedgerSnapshot:
        """What the engine holds between requests: the load's owners, and decode's kept segments
        while they are kept."""
        owners = dict(self.load_ledger.by_owner)
        step = self.runner.decode_step
        if self.kept_decode_bytes and step is not None and step.is_kept:
            owners[DECODE_GRAPHS_OWNER] = self.kept_decode_bytes
        return LedgerSnapshot(self.load_ledger.budget_bytes, dict(sorted(owners.items())))

    @classmethod
    def load(cls, config: Config, *, show_progress: bool = True, is_dry_run: bool = False) -> Engine:
        """Load for serving; ``is_dry_run`` charges the ledger as a load would and allocates nothing."""
        model = open_gguf(resolve_model_path(config.model.path))
        if not is_dry_run:
            loading.check_weights_finite(model)
        tokenizer = Tokenizer.from_metadata(model.metadata)
        plugins, config = load_plugins(config)
        backend = select_backend(config)
        require_runnable_tensors(model, backend)
        if not is_dry_run:
            loading.claim_loan_device(config, backend)  # before anything is allocated or deferred
        ledger = VramLedger(loading.budget_bytes(config, backend, model))
        ops = DryRunOps(ledger, backend, config.runtime.device) if is_dry_run \
            else make_ops(backend, ledger, config.runtime.device)
        ops.is_deterministic = config.runtime.deterministic
        rates = loading.prefill_rates(config, ops, backend)  # before placement: the probe's buffers fit
        spec = model.spec
        layout = ops.expert_layout(model) if spec.is_moe else None
        mtp_layout = loading.mtp_expert_layout(config, model, ops) if spec.is_moe else None
        placement = plan_placement(config, model, layout, ledger.budget_bytes,
                                   ops.prefill_kv_scratch_bytes_per_cell(spec.head_dim, spec.kv_size,
                                                                         config.runtime.kv_type),
                                   is_kv_staged=ops.is_kv_staged, mtp_layout=mtp_layout,
                                   weight_scratch_bytes=ops.prefill_weight_scratch_bytes(
                                       model, spec.num_layers + (spec.num_nextn_layers if config.runtime.mtp else 0)))
        loading.check_host_kv_fits(config, placement)
        resources = loading.decode_resources(config, model, ops, placement, mtp_layout)
        admit(config, plugins, resources)
        if not is_dry_run:
            for resource in resources.values():
                if isinstance(resource, (TensorsResource, ExpertsResource)):
                    resource.encode_host_copies()
        weights = DeviceWeights(ops, model)
        mtp_prompt = loading.mtp_prompt_weights(config, model, ops)
        kv = ops.kv_cache("kv_cache", spec.num_layers, placement.context_cells, spec.num_kv_heads, spec.head_dim,
                          config.runtime.kv_type, resident_cells=placement.kv_cells, staging_owner=KV_STAGING_OWNER)
        mtp_kv = ops.kv_cache(MTP_KV_OWNER, 1, placement.context_cells, spec.num_kv_heads, spec.head_dim,
                              config.runtime.kv_type) if MTP_DRAFT_HEAD in resources else None
        pack = loading.expert_pack(config, model, ops, layout, show_progress) if layout and not is_dry_run else None
        if layout and is_dry_run and config.model.expert_pack is not None:
            ExpertPack.check(config.model.expert_pack, model, layout)  # what the load would refuse
        cache = ExpertCache(ops, layout, segment_bytes=config.runtime.vmm_segment_bytes,
                            reserved_bytes=placement.cache_reserved_bytes, base_bytes=placement.cache_base_bytes,
                            max_slots=spec.num_layers * spec.num_experts
                            + largest_ring_slots(config.planner, placement.costs.target_ring_slots)) if layout else None
        if cache:
            loading.check_cache_maps_a_segment(config, placement, cache)
            cache.min_cache_slots = loading.min_cache_slots(config, cache.num_slots, spec)
        cost_model = PrefillCostModel.from_spec(
            spec, layout.slot_bytes, pcie_bytes_per_s=rates.pcie.value, compute_flops_per_s=rates.compute.value,
            chunk_overhead_s=config.planner.chunk_overhead_s) if layout else None
        # the cache unmaps segments of its own size for activations (the device rounds each plane up)
        costs = dataclasses.replace(placement.costs, segment_bytes=cache.segment_bytes) if cache else placement.costs
        planner = Planner(costs, config.planner, placement.context_cells, cost_model, rates)
        workspace = PromptWorkspace(ops, cache, costs)
        state = RuntimeState(RuntimeSettings(copy_overlap=config.runtime.copy_overlap),
                             apply=lambda settings: setattr(ops, "is_copy_overlapped", settings.copy_overlap),
                             residency=CacheResidency(cache, pack) if cache else None)
        mtp_share = cost_model.mtp_share(spec) if cost_model and mtp_kv is not None else 0.0
        loan = LoanTransaction(config=config, plugins=plugins, ledger=ledger, resources=resources, cache=cache,
                               planner=planner, workspace=workspace, state=state, mtp_prefill_share=mtp_share,
                               is_mtp_prompt_kept=mtp_prompt is not None)
        loan.start(loading.cache_after_load(config, cache, spec))
        expected = dict(ledger.snapshot().by_owner)
        for resource in resources.values():
            if not resource.is_resident:
                expected[resource.name] = expected.get(resource.name, 0) + resource.num_bytes
        runner = ModelRunner(spec, ops, weights, kv, cache, pack, config.runtime.decode_graphs,
                             config.runtime.decode_prefetch, config.runtime.decode_misses == "host")
        engine = cls(config=config, model=model, spec=spec, tokenizer=tokenizer, plugins=plugins, backend=backend,
                     ledger=ledger, ops=ops, placement=placement, resources=resources, weights=weights, kv=kv,
                     pack=pack, cache=cache, planner=planner, workspace=workspace, state=state, loan=loan,
                     runner=runner,
                     load_ledger=LedgerSnapshot(ledger.budget_bytes, dict(sorted(expected.items()))),
                     model_name=config.model.name or model.path.stem,
                     context_tokens=placement.context_cells)
        rt = config.runtime
        if mtp_kv is not None:
            engine.mtp = MtpDraft(runner, resources[MTP_DRAFT_HEAD], resources.get(MTP_EXPERTS), mtp_kv,
                                  engine.output_head, mtp_prompt)
            engine.depth_policy = DepthPolicy(rt.spec_depth, is_fixed=rt.spec_policy == "fixed")
            if rt.greedy_on_device and VERIFIER in resources:
                runner.attach_speculation(engine.mtp, rt.spec_depth, resources[VERIFIER])
        if backend == "cuda" and not is_dry_run:
            engine.compiles.listen()
        if not is_dry_run:
            engine.collector.listen()
        try:
            if config.runtime.warmup and not is_dry_run:
                engine.ops.prepare_weights(engine.matmul_weights())
            is_warming_up = config.runtime.warmup and backend in ("cuda", "cudasim") and not is_dry_run
            if is_warming_up:
                engine.warm_up()
            if config.runtime.expert_preload and cache and pack is not None:
                started = time.perf_counter()
                num_filled = cache.fill(pack, spec.num_layers, spec.num_experts)
                log.info("expert cache filled with %d of %d experts in %.2f s", num_filled,
                         spec.num_layers * spec.num_experts, time.perf_counter() - started)
            if is_warming_up:
                engine.prepare_decode()
        except BaseException:
            engine.compiles.close()  # numba-cuda's listener list would keep it for the process's life
            engine.collector.close()
            raise
        if not is_dry_run:
            freeze_loaded()
            engine.is_collector_frozen = True
        return engine

    def matmul_weights(self) -> list:
        """The matrices every forward pass multiplies by: the layers' dense ones and the output head (the
        embedding where it is tied, read row by row otherwise; a head a startup loan holds back is out)."""
        matrices = [tensor for name, tensor in self.weights.matrices.items() if name != "token_embd"]
        head = self.resources.get(OUTPUT_HEAD)
        if head is None or head.is_resident:
            matrices.append(self.output_head()[1])
        return matrices

    def prepare_decode(self) -> None:
        """Capture decode's segments before the first request and keep them across requests
        (``DecodeStep.prepare``): a request then pays no capture. The idle ledger counts them,
        unless they would leave no room for the smallest prefill of the idle engine."""
        if self.runner.decode_step is None:
            return
        head = self.resources.get("output_head")
        is_head_here = head is None or head.is_resident  # a startup loan may hold it back
        started = time.perf_counter()
        num_bytes = 0
        try:
            self.runner.prepare_decode(self.output_head() if self.config.runtime.greedy_on_device and is_head_here
                                       else None, max_rows=1 + (self.config.runtime.spec_depth if self.mtp else 0))
            num_bytes = self.ledger.snapshot().by_owner.get(DECODE_GRAPHS_OWNER, 0)
            self.loan.plan_preview(is_loan=False)  # every resource resident, as a request without a loan
        except AllocationError as exc:  # the capture itself, or the prefill after it, does not fit
            self.runner.reset_decode()
            self.ops.trim_memory()
            log.warning("decode segments are not kept across requests (%.1f MiB captured): %s; each request "
                        "captures its own", num_bytes / 2**20, exc)
            return
        self.kept_decode_bytes = num_bytes
        log.info("decode segments captured in %.2f s, kept across requests (%.1f MiB)",
                 time.perf_counter() - started, num_bytes / 2**20)

    def warm_up(self) -> float:
        """Compile every kernel a request uses, then reset (``warmup.py``); returns the seconds it took."""
        return warmup.warm_up(self)

    def generate(self, prompt_tokens: Sequence[int], params: SamplingParams,
                 is_cancelled: Callable[[], bool] = lambda: False,
                 draft_oracle: DraftOracle | None = None, is_timing_layers: bool = False) -> Generation:
        """Tokens for ``prompt_tokens``; iterate the result. Raises ``RequestError`` for a prompt that
        leaves no room in the context. One request at a time: a generation that starts while another
        is unfinished ends that one first (its iteration stops, finish reason "cancelled").
        draft_oracle: the bench's measurement mode (``strata bench --draft-oracle``), never serving's;
        is_timing_layers: the bench's ``--layer-timeline`` (``prefill_timeline.py``)."""
        return Generation(self, list(prompt_tokens), params, is_cancelled, draft_oracle, is_timing_layers)

    def format_placement(self) -> str:
        return (f"placement on {self.backend} ({self.ledger.budget_bytes / 2**30:.2f} GiB budget):\n"
                + self.ledger.format())

    def format_plan(self) -> str:
        lines = [f"startup plan (chunk / ring): {self.loan.startup_geometry}"]
        if self.loan.aliased_names():
            lines.append(f"plan with the output head lent to prefill (runtime.prefill_head_alias): "
                         f"{self.loan.plan_preview(is_loan=False)}")
        if self.config.loan.enabled:
            lines.append(f"plan without the loan: {self.loan.plan_preview(is_loan=False)}; "
                         f"with it: {self.loan.plan_preview(is_loan=True)}")
        return "\n".join(lines)

    def close(self) -> None:
        """Drop decode's segments and release what the engine holds outside the pool (the KV host
        tier's pinned memory, its fill stream); the engine serves no request after."""
        self.compiles.close()
        self.collector.close()
        if self.is_collector_frozen:
            thaw()  # what the engine held goes at the next collections
            self.is_collector_frozen = False
        self.runner.reset_decode()
        self.ops.synchronize()
        self.ops.close_kv(self.kv)
        self.ops.trim_memory()

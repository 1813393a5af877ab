"""What a loaded engine is made of: its parts, declared once, and the state it keeps between requests.

``Engine`` (facade.py) builds these parts in ``Engine.load`` and adds the load-time work (warm-up,
kept decode segments); a request (generation.py) reads them and updates the state between
requests: the tokens whose K and V are in the cache, the request that owns decode, the counters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from strata.backend.ops import Ops, QTensor
from strata.config import Config
from strata.engine.collector import CollectorWatch
from strata.engine.counters import EngineCounters
from strata.engine.decode.depth_policy import DepthPolicy
from strata.engine.decode.mtp import MtpDraft
from strata.engine.loan.resources import Resource
from strata.engine.loan.runtime_state import RuntimeState
from strata.engine.loan.transaction import LoanTransaction
from strata.engine.memory.expert_cache import ExpertCache
from strata.engine.memory.expert_pack import ExpertPack
from strata.engine.memory.workspace import PromptWorkspace
from strata.engine.planning.placement import Placement
from strata.engine.planning.planner import Planner
from strata.engine.runner import DeviceWeights, ModelRunner
from strata.gpu.compile_events import CompileCounter
from strata.gpu.ledger import LedgerSnapshot, VramLedger
from strata.hooktypes import OUTPUT_HEAD
from strata.model.gguf_file import GgufModel
from strata.model.spec import ModelSpec
from strata.model.tokenizer import Tokenizer
from strata.plugins import PluginHost


@dataclasses.dataclass(eq=False)
class EngineCore:
    """The loaded parts, and the state carried from one request to the next.

    :ivar backend: the ops backend's name (``numpy``, ``cuda``, ``cudasim``).
    :ivar kv: the KV cache, in the backend's own type.
    :ivar pack: the routed experts in host memory; None for a dense model or a dry run.
    :ivar cache: the elastic expert cache in VRAM; None for a dense model.
    :ivar load_ledger: what the load holds by owner, counting resources a startup loan defers.
    :ivar context_tokens: tokens a request may reach: ``runtime.context_tokens`` (KV cells past the resident ones
        live in the host tier).
    :ivar kv_tokens: tokens whose K and V are in the cache, in order (the next request's reusable prefix).
    :ivar current_generation: the request whose decode state (segments, cached blocks) is live.
    :ivar mtp: the MTP block that drafts for speculative decode; None without ``runtime.mtp``.
    :ivar compiles: the compilations since load (on the GPU; a request's timing line shows its own).
    :ivar collector: Python's collector passes since load (a request's timing line shows its own).
    """

    config: Config
    model: GgufModel
    spec: ModelSpec
    tokenizer: Tokenizer
    plugins: PluginHost
    backend: str
    ledger: VramLedger
    ops: Ops
    placement: Placement
    resources: dict[str, Resource]
    weights: DeviceWeights
    kv: Any
    pack: ExpertPack | None
    cache: ExpertCache | None
    planner: Planner
    workspace: PromptWorkspace
    state: RuntimeState
    loan: LoanTransaction
    runner: ModelRunner
    load_ledger: LedgerSnapshot
    model_name: str
    context_tokens: int
    mtp: MtpDraft | None = None  # speculative decode's draft block (runtime.mtp)
    depth_policy: DepthPolicy | None = None  # its depth, learnt across requests
    counters: EngineCounters = dataclasses.field(default_factory=EngineCounters)
    compiles: CompileCounter = dataclasses.field(default_factory=CompileCounter)
    collector: CollectorWatch = dataclasses.field(default_factory=CollectorWatch)
    is_collector_frozen: bool = False  # the load froze the interpreter's objects (``collector.freeze_loaded``)
    kv_tokens: list[int] = dataclasses.field(default_factory=list)
    current_generation: Any = None

    def output_head(self) -> tuple[Any, QTensor, float]:
        """(output norm, head, eps): the native head when the model has one, else the tied embedding."""
        head = self.resources.get(OUTPUT_HEAD)
        head_tensor = head.tensors["output"] if head is not None else self.weights.matrices["token_embd"]
        return self.weights.vectors["output_norm"], head_tensor, self.spec.rms_norm_eps

    def output_logits(self, hidden) -> np.ndarray:
        """[V] host logits of the last row of ``hidden`` [T, D]."""
        norm, head_tensor, eps = self.output_head()
        return self.ops.logits(hidden, norm, head_tensor, eps)

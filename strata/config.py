"""The TOML configuration: read, validated, frozen.

Tables: ``[model]``, ``[runtime]``, ``[planner]``, ``[serve]``, ``[loan]`` and one ``[loan.<plugin>]``
table per loan plugin. Plugin tables are validated once the plugins are loaded, against the
schema each plugin declares (``strata_config_tables``); until then they are kept as raw tables.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from strata.errors import ConfigError
from strata.schema import build_table, option, unknown_key_error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MIB = 1 << 20
KV_TYPES = ("f16", "q8_0", "q4_0")
MIN_RATE = 1e6  # planner.pcie_bytes_per_s and compute_flops_per_s: below this a value is a typo
BACKENDS = ("auto", "cuda", "cudasim", "numpy")
UNSUPPORTED_BACKENDS = {"hip": "HIP (AMD GPUs)", "rocm": "HIP (AMD GPUs)", "sycl": "SYCL", "vulkan": "Vulkan",
                        "metal": "Metal"}
_ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[^\s/?#:\[\]]+)(:[0-9]{1,5})?")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: Path = option(doc='GGUF file; "package:<module>/<file>" finds a file shipped inside an installed package',
                        kind="path")
    expert_pack: Path | None = option(None, doc="expert pack written by `strata pack` (default: pack in memory)",
                                      kind="path")
    name: str = option("", doc="model id served by the API (default: the GGUF file's stem)")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    backend: str = option("auto", doc="ops backend; auto picks cuda when a GPU is present, else numpy",
                          choices=BACKENDS, unsupported_choices=UNSUPPORTED_BACKENDS)
    device: int = option(0, doc="CUDA device ordinal", min=0)
    context_tokens: int = option(4096, doc="context length in tokens", min=16, max=1 << 22)
    kv_type: str = option("f16", doc="KV cache element format", choices=KV_TYPES)
    kv_resident_cells: int = option(0, doc="KV cells kept in VRAM (0: the whole context); the context's other "
                                           "cells live in pinned host memory and attention reads them from there",
                                    min=0)
    vram_budget_bytes: int = option(0, key="vram_budget", kind="bytes",
                                    doc='VRAM the engine may use, e.g. "8GiB" (0: the device\'s free memory)')
    vram_elastic: bool = option(False, doc="elastic expert cache on CUDA virtual-memory segments")
    vmm_segment_bytes: int = option(64 * MIB, key="vmm_segment", kind="bytes",
                                    doc='segment size of the elastic expert cache, e.g. "64MiB"', min=2 * MIB)
    serve: bool = option(False, doc="serve the OpenAI-compatible HTTP API (the main job)")
    mtp: bool = option(False, doc="multi-token-prediction speculative decoding with the model's MTP block")
    spec_depth: int = option(0, doc="most draft tokens per MTP speculation step (1..8 with mtp; 0: off)", min=0,
                             max=8)
    spec_policy: str = option("auto", doc='"auto": speculate at the depth (0..spec_depth) with the best measured '
                                          'tokens per second; "fixed": always draft spec_depth tokens',
                              choices=("auto", "fixed"))
    lock_dir: Path | None = option(None, kind="path", doc="directory of the per-GPU loan-taker locks (default: "
                                                          "$XDG_RUNTIME_DIR/strata, else <tmp>/strata-<uid>)")
    device_identity: str = option("", doc="what the one-loan-taker-per-GPU lock is keyed by (default: the CUDA "
                                          "device's UUID on the cuda backend; cudasim and numpy share no GPU and "
                                          "take the lock only when a stand-in identity is set here)")
    # features of the reference write-up that Strata does not have: declared so that setting one is
    # refused by name ("not supported by Strata") instead of accepted and ignored
    batch_slots: int = option(0, doc="concurrent batch sessions (not supported: 0 only)", min=0, max=256,
                              unsupported="concurrent batch sessions (Strata runs one request at a time)")
    pipeline_windows: int = option(0, doc="pipelined prefill windows (not supported: 0 only)", min=0, max=64,
                                   unsupported="pipelined prefill windows")
    layer_split: tuple[float, ...] = option((), doc="share of layers per device (not supported: one device only)",
                                            unsupported="splitting layers across devices (Strata runs on one GPU)",
                                            is_supported=lambda shares: len(shares) <= 1)
    helper_cache: bool = option(False, doc="helper-process expert cache (not supported)",
                                unsupported="a helper-process expert cache")
    remote_cache: str = option("", doc="address of a remote expert cache (not supported)",
                               unsupported="a remote expert cache")
    peer_cache: bool = option(False, doc="peer-GPU expert cache (not supported)", unsupported="a peer-GPU expert cache")
    prefill_head_alias: bool = option(False, doc="without the loan: lend the output head's VRAM to every prefill's "
                                                 "prompt workspace (uploaded again from its host copy after prefill)")
    warmup: bool = option(True, doc="at load, run a tiny prefill (once per MoE tile shape) and one decode step so "
                                    "that every kernel is compiled before the first request (cuda and cudasim "
                                    "backends); on numpy, dequantize the matrices the forward multiplies by")
    expert_preload: bool = option(True, doc="at load, fill the expert cache's free slots from the expert pack (an "
                                            "equal share of every layer), so the first requests find experts cached")
    decode_graphs: bool = option(True, doc="decode a token as CUDA graphs: one per layer and one more, or one for "
                                           "the token when every expert is cached (cuda backend; MoE models without a "
                                           "shared expert); with warmup, captured at load and kept across requests")
    copy_overlap: bool = option(True, doc="decode's expert copies run on a copy stream alongside the kernels; false: "
                                          "the kernels issued after a staging wait for it at once (prefill sets "
                                          "its own for its staging ring; a request puts this one back before decode)")
    decode_prefetch: bool = option(True, doc="with decode_graphs: stage the experts the next layer's router picks "
                                             "from this layer's hidden state while this layer computes (its "
                                             "default: on with decode_graphs where decode_misses is \"stage\")")
    decode_misses: str = option("stage", doc="with decode_graphs, where a decode token's routed experts that "
                                             'the cache lacks are read: "stage": copied into cache slots between '
                                             "the layer's routing and its experts (a graph a layer, the host "
                                             'between); "host": read by the expert kernels from the pinned expert '
                                             "pack over PCIe, the cache unchanged during decode, the whole token "
                                             "one graph (cuda, expert formats of the C++ rows); elsewhere "
                                             '"stage"', choices=("stage", "host"))
    deterministic: bool = option(True, doc="prefill adds each token's routed-expert outputs in 64-bit fixed point "
                                            "(integer atomics, the same bits in any order) instead of float atomics, "
                                            "so one request gives the same tokens whatever order the GPU's tiles "
                                            "finish in and whatever the expert cache holds (the loan, the host KV "
                                            "tier); costs 8 bytes a prompt token and hidden element of prefill "
                                            "workspace (cuda backend; numpy sums in float64 either way); false: float "
                                            "atomics, ~1.5% faster long prefill on the reference H200")
    greedy_on_device: bool = option(True, doc="with decode_graphs: a greedy request (temperature 0) picks each "
                                              "token on the GPU inside the captured step (output head, logit bias, "
                                              "argmax) and reads back 4 bytes instead of the logits; sampled "
                                              "requests, and decode without captured graphs (decode_graphs "
                                              "off, the numpy backend, dense or shared-expert models), pick "
                                              "on the host")


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    chunk_quantum_tokens: int = option(256, doc="prefill chunks are multiples of this", min=16, max=4096)
    max_chunk_tokens: int = option(16384, doc="largest prefill chunk considered", min=16, max=1 << 20)
    min_ring_slots: int = option(2, doc="smallest staging ring (expert slots)", min=1)
    max_ring_slots: int = option(512, doc="largest staging ring (expert slots)", min=1, max=65536)
    max_retries: int = option(4, doc="smaller geometries tried after an allocation failure", min=0, max=64)
    cache_keep_share: float = option(0.5, doc="share of the startup expert cache the prompt workspace may not "
                                              "borrow (cache grown by a loan is all borrowable)", min=0.0, max=1.0)
    pcie_bytes_per_s: float = option(0.0, doc="host-to-device copy rate of the cost model, in bytes/s; 0 (the "
                                              "default): measured at load by a pinned-copy probe on the GPU "
                                              "(assumed 55e9 on numpy and cudasim); a value fixes it", min=0.0)
    compute_flops_per_s: float = option(0.0, doc="prefill compute rate of the cost model, in FLOP/s; 0 (the "
                                                 "default): calibrated from the engine's own prefill chunks (20e12 "
                                                 "until the first); a value fixes it", min=0.0)
    chunk_overhead_s: float = option(0.05, doc="fixed cost of one prefill chunk in the cost model (launches, "
                                               "routing, synchronization), in seconds", min=0.0, max=60.0)
    chunk_tokens: int = option(0, doc="prefill in chunks of this many tokens, whatever the budget would allow "
                                      "(0: the planner decides); a request whose budget cannot hold it fails",
                               min=0, max=1 << 20)
    ring_slots: int = option(0, doc="staging ring of this many expert slots (0: the planner decides); with "
                                    "chunk_tokens, one geometry for every request (the loan then only moves "
                                    "the expert cache)", min=0, max=65536)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    host: str = option("127.0.0.1", doc="address to listen on")
    port: int = option(8080, doc="TCP port", min=0, max=65535)
    api_key: str = option("", doc="bearer token required from clients ('' : none)")
    max_queue: int = option(16, doc="requests waiting for the engine before 503", min=1, max=4096)
    max_body_bytes: int = option(4 * MIB, kind="bytes", doc="largest request body", min=1024)
    cors_origins: tuple[str, ...] = option((), doc='origins browsers may call the API from, e.g. '
                                                   '["http://localhost:3000"]; "*" allows any (default: none)')
    parse_special_in_content: bool = option(False, doc="read control-token texts such as <|im_end|> typed in chat "
                                                       "messages as those tokens (default: as plain text; the "
                                                       "template's own control tokens are tokens either way)")


@dataclasses.dataclass(frozen=True)
class LoanConfig:
    enabled: bool = option(False, doc="master switch of the request-scoped prefill VRAM loan")
    plugins: tuple[str, ...] = option((), doc="loan plugins to enable, in release order (the allow-list)")
    # [loan.<plugin>] tables: raw until the plugins load, then validated instances of their schemas
    tables: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    runtime: RuntimeConfig
    planner: PlannerConfig
    serve: ServeConfig
    loan: LoanConfig
    source: Path | None = None

    def plugin_options(self, name: str) -> Any:
        """The validated ``[loan.<name>]`` table of a loaded plugin."""
        return self.loan.tables[name]


_SECTIONS = {"model": ModelConfig, "runtime": RuntimeConfig, "planner": PlannerConfig, "serve": ServeConfig}


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_config(data, base_dir=path.parent.resolve(), source=path)


def parse_config(data: Mapping[str, Any], base_dir: Path | None = None, source: Path | None = None) -> Config:
    valid = [*_SECTIONS, "loan"]
    for key in data:
        if key not in valid:
            raise unknown_key_error(key, "", valid)
    if "model" not in data:
        raise ConfigError("[model] is required: set model.path to a GGUF file")
    sections = {name: build_table(cls, data.get(name, {}), name, base_dir) for name, cls in _SECTIONS.items()}
    runtime_table = data.get("runtime", {})
    if isinstance(runtime_table, Mapping) and "decode_prefetch" not in runtime_table:
        # the prediction runs inside the captured layer: off where decode is not captured
        runtime = sections["runtime"]  # prefetching stages: nothing to do where misses are read in place
        sections["runtime"] = dataclasses.replace(runtime, decode_prefetch=runtime.decode_graphs
                                                  and runtime.decode_misses == "stage")
    config = Config(**sections, loan=_parse_loan(data.get("loan", {})), source=source)
    verify_config(config)
    return config


def _parse_loan(table: Mapping[str, Any]) -> LoanConfig:
    if not isinstance(table, Mapping):
        raise ConfigError("loan must be a table")
    scalars = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
    raw_tables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    for key in scalars:
        if key not in ("enabled", "plugins"):
            raise unknown_key_error(key, "loan", ["enabled", "plugins", "<plugin name> (a table)"])
    base = build_table(LoanConfig, {k: v for k, v in scalars.items()}, "loan")
    duplicates = {p for p in base.plugins if base.plugins.count(p) > 1}
    if duplicates:
        raise ConfigError(f"loan.plugins lists {', '.join(sorted(duplicates))} more than once; list each plugin once")
    return dataclasses.replace(base, tables=MappingProxyType(dict(raw_tables)))


def verify_config(config: Config) -> None:
    """Cross-field checks that hold whether or not a loan is enabled; each names both options."""
    rt = config.runtime
    if rt.spec_depth and not rt.mtp:
        raise ConfigError(f"runtime.spec_depth = {rt.spec_depth} needs runtime.mtp = true; "
                          "set runtime.mtp = true or set runtime.spec_depth = 0")
    if rt.mtp and not rt.spec_depth:
        raise ConfigError("runtime.mtp = true needs runtime.spec_depth in 1..8 (the most tokens a step drafts); "
                          "set runtime.spec_depth = 4, or runtime.mtp = false")
    if rt.decode_prefetch and not rt.decode_graphs:
        raise ConfigError("runtime.decode_prefetch = true needs runtime.decode_graphs = true (the prediction runs "
                          "inside the captured layer); set runtime.decode_graphs = true or "
                          "runtime.decode_prefetch = false")
    if rt.decode_misses == "host" and not rt.decode_graphs:
        raise ConfigError('runtime.decode_misses = "host" needs runtime.decode_graphs = true (the token is one '
                          'captured graph); set runtime.decode_graphs = true or runtime.decode_misses = "stage"')
    if rt.decode_misses == "host" and rt.decode_prefetch:
        raise ConfigError('runtime.decode_prefetch = true stages experts ahead, which runtime.decode_misses = "host" '
                          'never does (misses are read in place); set runtime.decode_prefetch = false or '
                          'runtime.decode_misses = "stage"')
    pl = config.planner
    if pl.ring_slots and not pl.min_ring_slots <= pl.ring_slots <= pl.max_ring_slots:
        raise ConfigError(f"planner.ring_slots = {pl.ring_slots} is outside planner.min_ring_slots = "
                          f"{pl.min_ring_slots} .. planner.max_ring_slots = {pl.max_ring_slots}; set it in that "
                          "range, or 0 to let the planner decide")
    if rt.kv_resident_cells > rt.context_tokens:
        raise ConfigError(f"runtime.kv_resident_cells = {rt.kv_resident_cells} exceeds runtime.context_tokens = "
                          f"{rt.context_tokens}; lower kv_resident_cells or raise context_tokens")
    _check_resident_cells_hold_a_chunk(rt, config.planner)
    if any(share <= 0 for share in rt.layer_split):
        raise ConfigError(f"runtime.layer_split = {list(rt.layer_split)}: every share must be > 0")
    pl = config.planner
    for key, rate in (("pcie_bytes_per_s", pl.pcie_bytes_per_s), ("compute_flops_per_s", pl.compute_flops_per_s)):
        if 0 < rate < MIN_RATE:
            raise ConfigError(f"planner.{key} = {rate:g} is below {MIN_RATE:g}: set a measured rate (e.g. 55e9 "
                              "bytes/s, 90e12 FLOP/s) or 0 to let the engine measure it")
    if pl.min_ring_slots > pl.max_ring_slots:
        raise ConfigError(f"planner.min_ring_slots = {pl.min_ring_slots} exceeds planner.max_ring_slots = "
                          f"{pl.max_ring_slots}; lower min_ring_slots or raise max_ring_slots")
    if pl.max_chunk_tokens < pl.chunk_quantum_tokens:
        raise ConfigError(f"planner.max_chunk_tokens = {pl.max_chunk_tokens} is below planner.chunk_quantum_tokens"
                          f" = {pl.chunk_quantum_tokens}; raise max_chunk_tokens")
    if rt.backend == "cudasim" and not rt.vram_budget_bytes:
        raise ConfigError('runtime.backend = "cudasim" needs runtime.vram_budget: the simulator has no device '
                          'memory to measure; set for example vram_budget = "2GiB" under [runtime]')
    _check_origins(config.serve.cors_origins)
    if config.loan.plugins and not config.loan.enabled:
        raise ConfigError(f"loan.plugins = {list(config.loan.plugins)} has no effect without loan.enabled = true; "
                          "set loan.enabled = true or remove loan.plugins")


def _check_origins(origins: tuple[str, ...]) -> None:
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ConfigError(f"serve.cors_origins holds {origin!r}: each entry is an origin such as "
                              '"http://localhost:3000" (scheme://host[:port], no path) or "*" for any origin')


def bind_plugin_tables(config: Config, schemas: Mapping[str, type], available: list[str]) -> Config:
    """Validate every ``[loan.<name>]`` table against the schema its plugin declared.

    Enabled plugins without a table get the schema's defaults. A table for a name that no installed
    plugin provides is an error listing the available plugins.
    """
    tables: dict[str, Any] = {}
    for name, raw in config.loan.tables.items():
        if name not in available:
            raise ConfigError(f"[loan.{name}] configures no installed plugin; available plugins: "
                              f"{', '.join(sorted(available)) or 'none'}")
        schema = schemas.get(name)
        if schema is None:
            if raw:
                raise ConfigError(f"[loan.{name}] has keys but plugin {name} declares no options; remove the table")
            continue
        tables[name] = build_table(schema, raw, f"loan.{name}")
    for name in config.loan.plugins:
        if name not in tables and name in schemas:
            tables[name] = build_table(schemas[name], {}, f"loan.{name}")
    return dataclasses.replace(config, loan=dataclasses.replace(config.loan, tables=MappingProxyType(tables)))


def _check_resident_cells_hold_a_chunk(rt: RuntimeConfig, pl: PlannerConfig) -> None:
    """A host tier holds the context's tail: a prefill chunk fits in the resident cells."""
    if not rt.kv_resident_cells or rt.kv_resident_cells >= rt.context_tokens:
        return
    key, chunk = ("planner.chunk_tokens", pl.chunk_tokens) if pl.chunk_tokens else \
        ("planner.max_chunk_tokens", pl.max_chunk_tokens)
    chunk = min(chunk, rt.context_tokens)
    if rt.kv_resident_cells < chunk:
        raise ConfigError(f"runtime.kv_resident_cells = {rt.kv_resident_cells} is smaller than one prefill chunk "
                          f"({key} = {chunk}); raise kv_resident_cells to at least {chunk}, or lower {key}")

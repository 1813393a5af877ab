"""One benchmark repetition in a fresh process: load, one request, print its figures as JSON.

Run by ``strata bench``; not a user command. The prompt is N token ids drawn (seeded) from the
vocabulary's ordinary tokens; end-of-generation tokens are banned so every run generates exactly
the requested number of tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import sys
import time

import numpy as np

from strata.bench import host_cpu
from strata.bench.draft_oracle import DraftOracle
from strata.bench.host_numa import host_numa
from strata.bench.provenance import code_identity, device_name
from strata.config import load_config, verify_config

SPEC_MODES = ("config", "auto", "fixed", "off")  # and fixed-N: always N drafts (1 <= N <= runtime.spec_depth)
DECODE_MISSES = ("config", "stage", "host")  # runtime.decode_misses as configured, or either value
DETERMINISTIC = ("config", "off", "on")  # runtime.deterministic as configured, false or true


def bench_config(path: str, is_loan: bool, decode_misses: str = "config", deterministic: str = "config"):
    """The configuration at ``path`` for one arm: the loan off where ``is_loan`` is false,
    ``runtime.decode_misses`` set where ``decode_misses`` is not "config" (prefetching as that value's
    default has it: on with captured decode where misses are staged, off where they are read in place), and
    ``runtime.deterministic`` where ``deterministic`` is "off" or "on"."""
    config = load_config(path)
    if is_loan and not config.loan.enabled:
        raise SystemExit("the loan arm needs loan.enabled = true in the config")
    if not is_loan:
        config = dataclasses.replace(config, loan=dataclasses.replace(config.loan, enabled=False, plugins=(),
                                                                       tables={}))
    runtime = config.runtime
    if decode_misses != "config" and decode_misses != runtime.decode_misses:
        runtime = dataclasses.replace(runtime, decode_misses=decode_misses,
                                      decode_prefetch=runtime.decode_graphs and decode_misses == "stage")
        config = dataclasses.replace(config, runtime=runtime)
        verify_config(config)
    if deterministic != "config":
        config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime,
                                                                          deterministic=deterministic == "on"))
    return config


def prompt_tokens(tokenizer, num_tokens: int, seed: int) -> list[int]:
    ordinary = [i for i in range(tokenizer.vocab_size)
                if not tokenizer.is_special(i) and not tokenizer.is_eog(i) and tokenizer.token_piece(i)]
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.choice(np.array(ordinary), size=num_tokens)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata.bench.one_run")
    parser.add_argument("--config", required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--gen-tokens", type=int, required=True)
    parser.add_argument("--loan", choices=("on", "off"), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", help="write the request's host-side profile (cProfile stats) to this file")
    parser.add_argument("--spec", type=spec_mode, default="config",
                        help="speculative decode: as configured, the auto or fixed depth policy (fixed-N: N drafts "
                             "a step, at most runtime.spec_depth), or off (plain decode with the same memory)")
    parser.add_argument("--draft-oracle", type=float, default=None, metavar="P",
                        help="replace each draft by the greedy continuation with probability P (a plain run of "
                             "the same prompt first records it)")
    parser.add_argument("--host-cpu", default="any", type=host_cpu.choice,
                        help="the CPU the request's thread runs on: any (default), fastest (by a probe on each "
                             "CPU after load), or a CPU number")
    parser.add_argument("--layer-timeline", action="store_true",
                        help="time every prefill layer on the device and the host's issuing of it")
    parser.add_argument("--decode-misses", choices=DECODE_MISSES, default="config",
                        help="runtime.decode_misses for this run: as configured (default), stage or host")
    parser.add_argument("--deterministic", choices=DETERMINISTIC, default="config",
                        help="runtime.deterministic for this run: as configured (default), off or on")
    args = parser.parse_args(argv)

    from strata.engine.facade import Engine
    from strata.engine.sampling import SamplingParams
    from strata.plugins import discover

    started = time.perf_counter()
    engine = Engine.load(bench_config(args.config, args.loan == "on", args.decode_misses, args.deterministic),
                         show_progress=False)
    load_seconds = time.perf_counter() - started
    set_speculation(engine, args.spec)
    tokens = prompt_tokens(engine.tokenizer, args.prompt_tokens, args.seed)
    banned = {t: float("-inf") for t in engine.tokenizer.eog_ids}
    # seeded: no request reuses another's KV prefix, so each prefills the whole prompt
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, logit_bias=banned, seed=args.seed)
    oracle = None
    if args.draft_oracle is not None:
        if engine.mtp is None:
            raise SystemExit("--draft-oracle needs speculative decode (runtime.mtp = true and --spec other than off)")
        oracle = DraftOracle(None, len(tokens), args.draft_oracle, engine.spec.vocab_size, seed=args.seed)
    speeds = host_cpu.cpu_speeds()  # probes outside the profiled window: cProfile would slow them
    pinned_cpu = host_cpu.pin(args.host_cpu, speeds)
    probe_before, cpu_at_start = host_cpu.speed_probe(), host_cpu.current_cpu()
    generation = engine.generate(tokens, params, draft_oracle=oracle, is_timing_layers=args.layer_timeline)
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    cpu_before = host_cpu.snapshot()
    output = [event.token_id for event in generation if event.token_id >= 0]
    cpu = host_cpu.between(cpu_before, host_cpu.snapshot())
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    cpu.update(probe_seconds=(probe_before, host_cpu.speed_probe()), cpus=(cpu_at_start, host_cpu.current_cpu()),
               cpu_speeds=speeds, pinned_cpu=pinned_cpu)
    stats = generation.stats
    result = {
        "loan": args.loan, "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
        "chunk_tokens": stats.geometry.chunk_tokens, "ring_slots": stats.geometry.ring_slots,
        "num_chunks": stats.num_chunks, "prefill_tokens_per_s": stats.prefill_tokens_per_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s, "prefill_seconds": stats.prefill_seconds,
        "streamed_bytes": stats.streamed_bytes, "prefill_streamed_bytes": stats.prefill_streamed_bytes,
        "restaged_bytes": stats.restaged_bytes, "kv_host_bytes": stats.kv_host_bytes,
        "cache_hit_rate": stats.cache_hit_rate, "prefetched_experts": stats.prefetched_experts,
        "prefetched_used_experts": stats.prefetched_used_experts, "decode_seconds": stats.decode_seconds,
        "decode_wait_seconds": stats.decode_wait_seconds,
        "num_compiles": stats.num_compiles, "compile_seconds": stats.compile_seconds,
        "prefill_forward_seconds": stats.prefill_forward_seconds, "prefill_mtp_seconds": stats.prefill_mtp_seconds,
        "prefill_layers": stats.prefill_layers,
        "collector_passes": stats.collector.num_passes, "collector_full_passes": stats.collector.num_full_passes,
        "collector_seconds": stats.collector.seconds, "prefill_collector_seconds": stats.prefill_collector.seconds,
        "loan_summary": stats.loan.summary() if stats.loan else "", "load_seconds": load_seconds,
        "kernels_loaded": engine.compiles.tally.num_loaded,  # by the load's warm-up, from the kernel cache
        "backend": engine.backend, "budget_bytes": engine.ledger.budget_bytes,
        "expert_bytes": engine.pack.num_bytes if engine.pack else 0,
        "active_params": _active_params(engine.spec),
        "attention_width": engine.spec.q_size * engine.spec.num_layers,
        **decode_read_bytes(engine.model, engine.placement),
        "timing_line": stats.timing_line(), "code": code_identity(),
        "device": device_name(engine.backend, engine.config.runtime.device), "plugins": sorted(discover()),
        # the cost model's rates after the request: the probe's PCIe rate, the compute rate its chunks calibrated
        "pcie_bytes_per_s": engine.planner.rates.pcie.value, "pcie_source": engine.planner.rates.pcie.source,
        "compute_flops_per_s": engine.planner.rates.compute.value,
        "compute_source": engine.planner.rates.compute.source,
        "spec": args.spec if engine.mtp is not None or args.spec == "off" else "none",
        "decode_misses": engine.config.runtime.decode_misses, "decode_misses_arm": args.decode_misses,
        "deterministic": engine.config.runtime.deterministic, "deterministic_arm": args.deterministic,
        "draft_oracle": args.draft_oracle, "spec_rounds": stats.spec_rounds, "spec_drafted": stats.spec_drafted,
        "spec_accepted": stats.spec_accepted, "spec_depth": stats.spec_depth,
        "spec_launch_seconds": stats.spec_launch_seconds,
        "spec_depth_max": engine.config.runtime.spec_depth,
        "depth_policy": engine.depth_policy.summary() if engine.depth_policy is not None else "",
        # with the oracle: the measured run's tokens are the plain run's (greedy output must not change)
        "is_output_equal": output == oracle.continuation if oracle is not None else None,
        "first_difference": _first_difference(output, oracle.continuation) if oracle is not None else None,
        "output_ids": output,  # runs of one seed and prompt compare token for token (e.g. the KV host tier)
        "host_numa": host_numa(),  # where the pinned experts live: a process-to-process difference
        "tensor_cores_off": _tensor_cores_off(engine.backend),
        "host_cpu": cpu,  # stolen time, a busy machine or waits for a CPU slow every function alike
    }
    print("STRATA-BENCH " + json.dumps(result), flush=True)
    engine.close()
    return 0


def _first_difference(output: list[int], expected: list[int]) -> int | None:
    """The first place where ``output`` leaves ``expected`` (or one ends before the other); None where equal."""
    if output == expected:
        return None
    return next((i for i, (a, b) in enumerate(zip(output, expected)) if a != b), min(len(output), len(expected)))


def _tensor_cores_off(backend: str) -> str | None:
    """Why a cuda run's prefill ran the pure-Numba kernels (several times slower), or None."""
    if backend != "cuda":
        return None
    from strata.gpu.kernels import tensor_core

    return tensor_core.unavailable_reason()


def spec_mode(text: str) -> str:
    """--spec's value: one of SPEC_MODES, or fixed-N with N >= 1."""
    if text in SPEC_MODES:
        return text
    depth = text.removeprefix("fixed-")
    if depth != text and depth.isdigit() and int(depth) >= 1:
        return text
    raise argparse.ArgumentTypeError(f"--spec takes {', '.join(SPEC_MODES)} or fixed-N (N >= 1), got {text!r}")


def set_speculation(engine, mode: str) -> None:
    """--spec: the configured policy, another one, or none (plain decode; the memory stays as loaded)."""
    from strata.engine.decode.depth_policy import DepthPolicy

    if engine.mtp is None or mode == "config":
        return
    if mode == "off":
        engine.mtp = engine.depth_policy = None
        return
    max_depth = engine.config.runtime.spec_depth
    depth = int(mode.removeprefix("fixed-")) if mode.startswith("fixed-") else max_depth
    if depth > max_depth:
        raise SystemExit(f"--spec {mode}: at most runtime.spec_depth = {max_depth} drafts a step (the verifier "
                         "arena and the kept segments are sized for it); raise runtime.spec_depth")
    engine.depth_policy = DepthPolicy(depth, is_fixed=mode != "auto")


def decode_read_bytes(model, placement) -> dict:
    """What one decode token reads from VRAM, apart from the KV cache, and the KV bytes a cell.

    ``dense_read_bytes``: the placement's dense weights without the embedding table (a token reads
    one row of it); ``head_read_bytes``: the output head (the embedding table when tied);
    ``expert_read_bytes``: the top-k routed experts of every main layer (a layer's expert tensors
    over its expert count, times k); ``kv_bytes_per_cell``: the placement's KV bytes over its cells.
    """
    spec, tensors = model.spec, model.tensors
    embedding = tensors["token_embd.weight"].nbytes
    head = tensors["output.weight"].nbytes if "output.weight" in tensors else embedding
    experts = 0
    if spec.is_moe:
        for layer in range(spec.num_layers):
            names = (f"blk.{layer}.{t}.weight" for t in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
            layer_bytes = sum(tensors[n].nbytes for n in names if n in tensors)
            experts += layer_bytes * spec.num_experts_used // spec.num_experts
    return {"dense_read_bytes": placement.dense_bytes - embedding, "head_read_bytes": head,
            "expert_read_bytes": experts, "kv_bytes_per_cell": placement.kv_bytes / max(1, placement.kv_cells)}


def _active_params(spec) -> int:
    """Weights one token multiplies through: attention, its k experts (or dense FFN), the head."""
    attention = spec.hidden_size * (2 * spec.q_size + 2 * spec.kv_size)
    ffn = 3 * spec.hidden_size * (spec.num_experts_used * spec.expert_ffn_size + spec.shared_expert_ffn_size
                                  if spec.is_moe else spec.dense_ffn_size)
    router = spec.hidden_size * spec.num_experts
    return spec.num_layers * (attention + ffn + router)


if __name__ == "__main__":
    sys.exit(main())

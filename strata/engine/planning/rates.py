"""The cost model's rates, measured rather than configured.

PCIe host→device: a probe at load (the backend copies a pinned host buffer of a few sizes to the
device and times each copy with events); the rate is the least-squares slope of bytes over
seconds, so a fixed latency per copy does not lower it. A backend without a device to probe
(numpy, the CUDA simulator, a dry run on a machine without a GPU) assumes the reference H200's
pinned rate and says so.

Compute: calibrated from the prefill chunks the engine runs. A chunk's FLOPs are the cost
model's own count (``PrefillCostModel.chunk_flops``); its time is the device's, between events
around the chunk. The cost model predicts ``chunk_s = max(copy_s, compute_s) + chunk_overhead_s``,
so a chunk whose time is clearly more than its copies (its streamed bytes at the PCIe rate) and
the overhead is compute-bound and gives ``compute_s``, hence a rate; a copy-bound chunk only
says the rate is at least its FLOPs over its time, and raises a rate below that (until the next
compute-bound chunk, whose measure replaces it). Rates are
smoothed over chunks (``DECAY``: each later chunk halves an earlier one's weight), weighted by
FLOPs, so big chunks, the ones the planner weighs for long prompts, count most.

A configured rate (``planner.pcie_bytes_per_s``, ``planner.compute_flops_per_s``) wins: no probe
runs for it, no chunk changes it, and it is labelled as configured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from strata.config import PlannerConfig
from strata.engine.planning.prefill_cost import PrefillCostModel

ASSUMED_PCIE_BYTES_PER_S = 55e9  # pinned copies on the reference H200
ASSUMED_COMPUTE_FLOPS_PER_S = 20e12  # until the first prefill chunk calibrates it
DECAY = 0.5
COPY_MARGIN = 0.1  # a chunk this much longer than its copies and overhead is compute-bound


@dataclasses.dataclass(frozen=True)
class Rate:
    value: float
    source: str  # how it was obtained: configured, measured, calibrated or assumed, and from what

    @property
    def kind(self) -> str:
        """The source's first word: configured, measured, calibrated or assumed."""
        return self.source.split()[0].rstrip(":")


@dataclasses.dataclass(frozen=True)
class ChunkTiming:
    """One prefill chunk as it ran: its tokens, its first position, the expert bytes it streamed,
    the device seconds it took and whether its copies overlapped its kernels."""

    num_tokens: int
    start: int
    streamed_bytes: int
    seconds: float
    is_overlapped: bool = True


def pcie_rate(samples: Sequence[tuple[int, float]]) -> float:
    """Bytes per second from (bytes, seconds) copies: the slope of a least-squares line through
    them, or bytes over seconds of them all when the sizes do not spread (or the slope is not positive)."""
    num_bytes = [float(b) for b, _ in samples]
    seconds = [s for _, s in samples]
    mean_b, mean_s = sum(num_bytes) / len(samples), sum(seconds) / len(samples)
    spread = sum((b - mean_b) ** 2 for b in num_bytes)
    covariance = sum((b - mean_b) * (s - mean_s) for b, s in zip(num_bytes, seconds))
    if spread > 0 and covariance > 0:
        return spread / covariance
    return sum(num_bytes) / sum(seconds)


def probed_pcie(samples: Sequence[tuple[int, float]] | None, backend: str, probe_seconds: float = 0.0) -> Rate:
    """The PCIe rate from the load's probe, or the assumed one when ``backend`` had no device to probe."""
    if not samples:
        return Rate(ASSUMED_PCIE_BYTES_PER_S, f"assumed: {backend} backend, no GPU to probe; the reference "
                                              "H200's pinned rate")
    sizes = sorted({b for b, _ in samples})
    return Rate(pcie_rate(samples), f"measured at load: {len(samples)} pinned copies of "
                                    f"{_mib(sizes[0])}-{_mib(sizes[-1])} MiB in {probe_seconds:.2f} s")


class PrefillRates:
    """The two rates the planner's cost model predicts with; the compute rate learns from chunks."""

    def __init__(self, pcie: Rate, compute: Rate, is_calibrated: bool):
        self.pcie = pcie
        self.compute = compute
        self.is_calibrated = is_calibrated
        self.num_chunks = 0  # compute-bound chunks calibrated from
        self.num_bound_chunks = 0  # copy-bound chunks that raised the rate to a floor
        self._flops = 0.0  # decayed sums of those chunks' FLOPs and compute seconds
        self._seconds = 0.0

    @classmethod
    def from_config(cls, config: PlannerConfig, probe: Rate | None) -> PrefillRates:
        """A configured rate wins; else the probe's PCIe rate and the assumed compute rate, calibrated as chunks run."""
        pcie = Rate(config.pcie_bytes_per_s, "configured by planner.pcie_bytes_per_s") if config.pcie_bytes_per_s \
            else probe or Rate(ASSUMED_PCIE_BYTES_PER_S, "assumed: not probed")
        if config.compute_flops_per_s:
            return cls(pcie, Rate(config.compute_flops_per_s, "configured by planner.compute_flops_per_s"), False)
        return cls(pcie, Rate(ASSUMED_COMPUTE_FLOPS_PER_S, "assumed until a prefill chunk calibrates it"), True)

    def record(self, model: PrefillCostModel, chunks: Sequence[ChunkTiming]) -> None:
        """Calibrate the compute rate from chunks a prefill ran (nothing when it is configured)."""
        if not self.is_calibrated:
            return
        for chunk in chunks:
            flops = model.chunk_flops(chunk.num_tokens, chunk.start)
            copy_s = chunk.streamed_bytes / self.pcie.value
            busy_s = chunk.seconds - model.chunk_overhead_s
            if flops <= 0 or busy_s <= 0:
                continue
            compute_s = busy_s if chunk.is_overlapped else busy_s - copy_s
            if chunk.is_overlapped and busy_s <= copy_s * (1 + COPY_MARGIN):
                if flops / busy_s > self.compute.value:  # copy-bound: the rate is at least this
                    self.num_bound_chunks += 1
                    self.compute = Rate(flops / busy_s, self._calibrated_source())
                continue
            if compute_s <= COPY_MARGIN * busy_s:  # serial copies took nearly all of it: too noisy to tell
                continue
            self._flops = DECAY * self._flops + flops
            self._seconds = DECAY * self._seconds + compute_s
            self.num_chunks += 1
            self.compute = Rate(self._flops / self._seconds, self._calibrated_source())

    def _calibrated_source(self) -> str:
        text = f"calibrated from {self.num_chunks} compute-bound prefill chunk(s)"
        return text + (f", floored by {self.num_bound_chunks} copy-bound one(s)" if self.num_bound_chunks else "")

    def describe(self) -> str:
        return (f"PCIe host→device {self.pcie.value / 1e9:.1f} GB/s, {self.pcie.source}; "
                f"compute {self.compute.value / 1e12:.1f} TFLOP/s, {self.compute.source}")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:g}"

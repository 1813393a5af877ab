"""A request's expert traffic, counted by the runner's forward pass and by decode."""

from __future__ import annotations

import dataclasses
import time
from typing import Any


@dataclasses.dataclass
class StreamStats:
    """Expert traffic of a request. Hits and misses count experts per layer: in a prefill chunk that
    streams every uncached expert, hits are the layer's cached experts and misses the ones streamed;
    otherwise, the distinct routed experts found in the cache and the ones streamed."""

    streamed_bytes: int = 0
    num_chunks: int = 0
    hits: int = 0
    misses: int = 0
    prefetched: int = 0  # experts decode staged ahead of their layer (in streamed_bytes, not in misses)
    prefetched_used: int = 0  # of those, the ones their layer routed the token to (the rest were bytes spent early)
    kv_host_bytes: int = 0  # KV cells read from and written to the host tier (``ops.host_tier_bytes``)
    decode_wait_seconds: float = 0.0  # captured decode: the host blocked on the device (``waited``)
    spec_rounds: int = 0  # speculation: verify steps
    spec_draft_steps: int = 0  # MTP block steps that drafted a token
    spec_drafted: int = 0  # draft tokens verified
    spec_accepted: int = 0  # of those, the ones the target model agreed with
    spec_depth: int = 0  # the depth the policy chose last (0: plain decode)
    # speculation on the device: the host's time launching verify steps and their drafts (a graph replay costs
    # ~5-25 us, more where it waits for room in the device's launch queue)
    spec_launch_seconds: float = 0.0
    # [spec_depth max] drafts verified and accepted at each place of a step's draft run
    spec_drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    spec_accepted_by_position: list[int] = dataclasses.field(default_factory=list)
    timeline: Any = None  # a PrefillTimeline the runner marks each prefill layer in (the bench's --layer-timeline)

    def waited(self, read, *args):
        """read(*args), a readback that blocks on the device; its time is added to decode_wait_seconds."""
        started = time.perf_counter()
        result = read(*args)
        self.decode_wait_seconds += time.perf_counter() - started
        return result

    def record_round(self, num_drafted: int, num_accepted: int) -> None:
        """One verify step: ``num_drafted`` drafts checked, the first ``num_accepted`` of them taken."""
        self.spec_rounds += 1
        self.spec_drafted += num_drafted
        self.spec_accepted += num_accepted
        missing = num_drafted - len(self.spec_drafted_by_position)
        if missing > 0:
            self.spec_drafted_by_position += [0] * missing
            self.spec_accepted_by_position += [0] * missing
        for place in range(num_drafted):
            self.spec_drafted_by_position[place] += 1
            self.spec_accepted_by_position[place] += place < num_accepted

"""A request's expert traffic, counted by the runner's forward pass and by decode."""

from __future__ import annotations

import dataclasses


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
    decode_wait_seconds: float = 0.0  # captured decode: the host blocked on the device's routing and token ids

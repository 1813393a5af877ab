"""The host's cost of replaying a captured graph (``GraphSegment.replay``, one ``cuGraphLaunch``), untraced.

Decode replays a handful of graphs a step, and ``device_trace`` times them under the profiler, which
records each kernel node and so inflates a replay's host time. This times replays with no profiler:
graphs of N one-block kernels that each wait ``--kernel-us`` on the device, replayed on an idle
device, back to back (one executable graph, then two alternating), and queued behind a long kernel,
where a replay blocks once the device's launch queue is full.

    python tools/graph_launch_cost.py [--nodes 100 400] [--kernel-us 10]

Needs a GPU (the simulator has no graphs).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _parse(argv: list[str]) -> argparse.Namespace:
    from strata.bench.soak import at_least

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=at_least(1), nargs="+", default=[100, 400], help="kernels a graph")
    parser.add_argument("--kernel-us", type=at_least(0), default=10, help="how long each kernel waits on the device")
    parser.add_argument("--queued", type=at_least(2), default=30, help="replays queued behind the long kernel")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from numba import config as numba_config
    from numba import cuda

    if numba_config.ENABLE_CUDASIM or not cuda.is_available():
        print("graph_launch_cost: needs a GPU (the CUDA simulator has no graphs)", file=sys.stderr)
        return 2
    from strata.backend.select import make_ops
    from strata.gpu.ledger import VramLedger

    @cuda.jit
    def wait_kernel(count, microseconds):  # one thread waits ~microseconds on the device
        if cuda.grid(1) == 0:
            for _ in range(microseconds):
                cuda.nanosleep(1000)
            count[0] += 1

    ops = make_ops("cuda", VramLedger(1 << 30))
    count = cuda.to_device(np.zeros(1, np.int64))

    def graph(num_nodes: int):
        def record():
            for _ in range(num_nodes):
                wait_kernel[1, 32, ops._stream](count, args.kernel_us)
            return ()
        segment = ops.capture(record)
        segment.replay()  # the first launch uploads the graph
        cuda.synchronize()
        return segment

    def row(name: str, replays: list) -> None:
        started = time.perf_counter()
        host_us = []
        for replay in replays:
            before = time.perf_counter()
            replay()
            host_us.append((time.perf_counter() - before) * 1e6)
        cuda.synchronize()
        wall_us = (time.perf_counter() - started) * 1e6
        print(f"| {name} | {len(host_us)} | {np.median(host_us):.1f} | {max(host_us):.1f} | {sum(host_us):.1f} | "
              f"{wall_us:.1f} |")

    print("| replays | n | host µs median | max | sum | µs until the device is done |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for num_nodes in args.nodes:
        first, second = graph(num_nodes), graph(num_nodes)
        row(f"{num_nodes} kernels, idle device", [first.replay])
        row(f"{num_nodes} kernels, one graph back to back", [first.replay] * 8)
        row(f"{num_nodes} kernels, two graphs alternating", [first.replay, second.replay] * 4)
    first, second = graph(args.nodes[0]), graph(args.nodes[0])
    for name, replays in (("one graph", [first.replay] * args.queued),
                          ("two graphs", [first.replay, second.replay] * (args.queued // 2))):
        wait_kernel[1, 32](count, 30_000)  # the device busy 30 ms: every replay below queues behind it
        row(f"{args.nodes[0]} kernels behind a 30 ms kernel, {name}", replays)
    return 0


if __name__ == "__main__":
    sys.exit(main())

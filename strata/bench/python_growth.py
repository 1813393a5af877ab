"""What the Python heap gains between two points of a soak: allocation sites (``tracemalloc``) and
live objects by type (the collector's census). A slope of the RSS that survives ``malloc_trim`` is
either such growth or native memory; this tells which, and where.
"""

from __future__ import annotations

import collections
import gc
import tracemalloc


class PythonGrowth:
    """Call ``start`` at the first point and ``report`` at the second."""

    def __init__(self, num_frames: int = 8):
        self.num_frames = num_frames
        self._snapshot: tracemalloc.Snapshot | None = None
        self._census = ObjectCensus()
        self._is_tracing_ours = False

    def start(self) -> None:
        self._census.start()  # before tracing: the census itself is not growth
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.num_frames)
            self._is_tracing_ours = True
        self._snapshot = tracemalloc.take_snapshot()

    def report(self, top: int = 10) -> dict:
        """The ``top`` sites by bytes gained (each with its innermost frames) and types by objects gained."""
        if self._snapshot is None:
            raise RuntimeError("PythonGrowth.report before start")
        gc.collect()
        stats = tracemalloc.take_snapshot().compare_to(self._snapshot, "traceback")
        if self._is_tracing_ours:
            tracemalloc.stop()
            self._is_tracing_ours = False
        sites = [{"bytes": stat.size_diff, "blocks": stat.count_diff,
                  "frames": [f"{frame.filename}:{frame.lineno}" for frame in list(stat.traceback)[-4:]]}
                 for stat in stats[:top] if stat.size_diff > 0]
        types = [{"type": name, "objects": num} for name, num in self._census.gained(top)]
        return {"traced_bytes_gained": sum(stat.size_diff for stat in stats), "sites": sites, "types": types}


class ObjectCensus:
    """The collector's census alone (no tracing, so the requests between keep their speed): live
    objects by type at ``start`` and at ``report``, the gain per request between."""

    def __init__(self):
        self._census: collections.Counter | None = None
        self._ids_at_start: set[int] = set()

    def start(self) -> None:
        gc.collect()
        objects = gc.get_objects()
        self._census = _census(objects)
        self._ids_at_start = {id(o) for o in objects}

    def gained(self, top: int = 12) -> list[tuple[str, int]]:
        """The ``top`` types by live objects gained since ``start``: (type, objects)."""
        if self._census is None:
            raise RuntimeError("ObjectCensus used before start")
        gc.collect()
        gained = _census(gc.get_objects())
        gained.subtract(self._census)
        return [(name, num) for name, num in gained.most_common(top) if num > 0]

    def holders(self, type_name: str, max_listed: int = 3, depth: int = 8) -> list[str]:
        """What holds up to ``max_listed`` objects of ``type_name`` that were not alive at ``start``: one
        referrer chain each, nearest first (``live_allocations.referrer_chain``; a scan of every object a link)."""
        from strata.gpu.live_allocations import describe_chain, referrer_chain

        born = [o for o in gc.get_objects() if _type_name(o) == type_name and id(o) not in self._ids_at_start]
        samples = born[:max_listed]
        del born
        return [describe_chain(referrer_chain(o, {id(samples)}, depth)) for o in samples]

    def report(self, num_requests: int, top: int = 12) -> list[dict]:
        """``gained`` with each type's gain per request (``num_requests`` since ``start``)."""
        return [{"type": name, "objects": num, "per_request": num / max(1, num_requests)}
                for name, num in self.gained(top)]


def format_census(types: list[dict], first_request: int, num_requests: int) -> str:
    lines = [f"live objects gained over {num_requests} request(s) from request {first_request}, by type:"]
    lines += [f"  {t['objects']:+9d} ({t['per_request']:+.1f}/request) {t['type']}" for t in types]
    return "\n".join(lines) if types else lines[0] + " none"


def format_holders(holders: dict[str, list[str]]) -> str:
    lines = []
    for name, chains in holders.items():
        lines.append(f"held {name}, new since the census began:" if chains else f"held {name}: none found")
        lines += [f"  {chain}" for chain in chains]
    return "\n".join(lines)


def _census(objects: list) -> collections.Counter:
    return collections.Counter(_type_name(obj) for obj in objects)


def _type_name(obj) -> str:
    kind = type(obj)  # type(), not __class__: a dead weak proxy's lookup raises
    return f"{kind.__module__}.{kind.__qualname__}"


def format_report(report: dict) -> str:
    lines = [f"Python heap: {report['traced_bytes_gained'] / 1024:+.1f} KiB traced"]
    for site in report["sites"]:
        where = " <- ".join(site["frames"][::-1])
        lines.append(f"  {site['bytes'] / 1024:+9.1f} KiB in {site['blocks']:+d} blocks at {where}")
    lines += [f"  {entry['objects']:+9d} {entry['type']}" for entry in report["types"]]
    return "\n".join(lines)

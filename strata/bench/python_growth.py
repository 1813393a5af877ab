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

    def start(self) -> None:
        gc.collect()
        self._census = _census()

    def gained(self, top: int = 12) -> list[tuple[str, int]]:
        """The ``top`` types by live objects gained since ``start``: (type, objects)."""
        if self._census is None:
            raise RuntimeError("ObjectCensus used before start")
        gc.collect()
        gained = _census()
        gained.subtract(self._census)
        return [(name, num) for name, num in gained.most_common(top) if num > 0]

    def report(self, num_requests: int, top: int = 12) -> list[dict]:
        """``gained`` with each type's gain per request (``num_requests`` since ``start``)."""
        return [{"type": name, "objects": num, "per_request": num / max(1, num_requests)}
                for name, num in self.gained(top)]


def format_census(types: list[dict], first_request: int, num_requests: int) -> str:
    lines = [f"live objects gained over {num_requests} request(s) from request {first_request}, by type:"]
    lines += [f"  {t['objects']:+9d} ({t['per_request']:+.1f}/request) {t['type']}" for t in types]
    return "\n".join(lines) if types else lines[0] + " none"


def _census() -> collections.Counter:
    return collections.Counter(f"{type(obj).__module__}.{type(obj).__qualname__}" for obj in gc.get_objects())


def format_report(report: dict) -> str:
    lines = [f"Python heap: {report['traced_bytes_gained'] / 1024:+.1f} KiB traced"]
    for site in report["sites"]:
        where = " <- ".join(site["frames"][::-1])
        lines.append(f"  {site['bytes'] / 1024:+9.1f} KiB in {site['blocks']:+d} blocks at {where}")
    lines += [f"  {entry['objects']:+9d} {entry['type']}" for entry in report["types"]]
    return "\n".join(lines)

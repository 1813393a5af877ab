"""Where a bench process's large host mappings live: NUMA nodes, page sizes, the CPUs it may run on.

Prefill streams the experts from pinned host memory; a DMA from memory on the node away from the
GPU's PCIe root, or over 4 KiB pages where huge pages were expected, runs slower, and which node a
page lands on depends on the CPU that first touched it, which can differ between fresh processes of
one build. A bench row records this so that a slow process can be told apart from a slow build.
Linux only (``/proc/self/numa_maps``); elsewhere, or without NUMA support, the record says so.
"""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

LARGE_MAPPING_BYTES = 256 * 2**20
_NODE_PAGES = re.compile(r"\bN(\d+)=(\d+)")
_PAGE_KB = re.compile(r"\bkernelpagesize_kB=(\d+)")
_MAPPING_RANGE = re.compile(r"[0-9a-f]+-[0-9a-f]+")


def parse_large_mappings(smaps_text: str, numa_maps_text: str, min_bytes: int = LARGE_MAPPING_BYTES) -> list[dict]:
    """Every mapping of at least ``min_bytes``: its size, what backs it, its transparent huge pages, and its
    resident bytes per node (``/proc/self/smaps`` and ``/proc/self/numa_maps``' texts)."""
    sizes, start = {}, None
    for line in smaps_text.splitlines():
        fields = line.split(maxsplit=5)
        if fields and _MAPPING_RANGE.fullmatch(fields[0]):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            sizes[start] = [end - start, fields[5].strip() if len(fields) > 5 else "[anonymous]", 0]
        elif start is not None and fields and fields[0] == "AnonHugePages:":
            sizes[start][2] = int(fields[1]) * 1024
    mappings = []
    for line in numa_maps_text.splitlines():
        fields = line.split(maxsplit=2)
        if len(fields) < 2:
            continue
        num_bytes, backing, huge_bytes = sizes.get(int(fields[0], 16), (0, "", 0))
        if num_bytes < min_bytes:
            continue
        page_kb = _PAGE_KB.search(line)
        page_bytes = int(page_kb.group(1)) * 1024 if page_kb else resource.getpagesize()
        nodes = {int(node): int(pages) * page_bytes for node, pages in _NODE_PAGES.findall(line)}
        is_hugetlb = " huge" in f" {fields[2] if len(fields) > 2 else ''}"  # numa_maps' token for hugetlbfs pages
        mappings.append({"bytes": num_bytes, "backing": backing, "policy": fields[1], "page_bytes": page_bytes,
                         "huge_bytes": sum(nodes.values()) if is_hugetlb else huge_bytes, "node_bytes": nodes})
    return mappings


def host_numa() -> dict:
    """The process's view: online nodes, allowed CPUs, and its large mappings (see parse_large_mappings)."""
    record: dict = {"cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    online = Path("/sys/devices/system/node/online")
    record["nodes_online"] = online.read_text().strip() if online.exists() else None
    try:
        record["large_mappings"] = parse_large_mappings(Path("/proc/self/smaps").read_text(),
                                                        Path("/proc/self/numa_maps").read_text())
    except OSError as exc:  # no procfs, or a kernel without NUMA support
        record["large_mappings"] = None
        record["error"] = f"{type(exc).__name__}: {exc}"
    return record


def mapping_kind(backing: str) -> str:
    """pinned (a driver's device file: page-locked host memory), file (the GGUF, the pack) or anonymous."""
    if backing.startswith("/dev/"):
        return "pinned"
    return "anonymous" if backing.startswith("[") else "file"


def summary(record: dict) -> str:
    """One line: resident bytes per node of each kind of large mapping, and the share of huge pages."""
    mappings = record.get("large_mappings")
    if mappings is None:
        return f"host NUMA: nodes {record.get('nodes_online')}, mappings not read ({record.get('error')})"
    if not mappings:
        return f"host NUMA: nodes {record.get('nodes_online')}, no mapping of {LARGE_MAPPING_BYTES >> 20} MiB or more"
    kinds = []
    for kind in ("pinned", "anonymous", "file"):
        of_kind = [m for m in mappings if mapping_kind(m["backing"]) == kind]
        if not of_kind:
            continue
        by_node: dict[int, int] = {}
        for m in of_kind:
            for node, num_bytes in m["node_bytes"].items():
                by_node[node] = by_node.get(node, 0) + num_bytes
        resident, huge = sum(by_node.values()), sum(m["huge_bytes"] for m in of_kind)
        nodes = " ".join(f"N{node} {num_bytes / 2**30:.1f}" for node, num_bytes in sorted(by_node.items()))
        kinds.append(f"{kind} {sum(m['bytes'] for m in of_kind) / 2**30:.1f} GiB (resident GiB {nodes or 'none'}"
                     f"{f', {huge / resident:.0%} huge pages' if resident else ''})")
    return (f"host NUMA: nodes {record.get('nodes_online')}, {len(record['cpus'] or [])} CPUs; "
            + "; ".join(kinds))

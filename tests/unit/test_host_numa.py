"""The bench's record of where its large host mappings live (procfs texts parsed; the process's own read)."""

from strata.bench.host_numa import host_numa, parse_large_mappings, summary

SMAPS = """\
7f0000000000-7f0040000000 rw-s 00000000 00:05 1234                       /dev/nvidiactl
Size:            1048576 kB
AnonHugePages:         0 kB
7f1000000000-7f1000001000 r--p 00000000 08:01 99                         /usr/lib/libc.so.6
Size:                  4 kB
AnonHugePages:         0 kB
7f2000000000-7f2020000000 rw-p 00000000 00:00 0
Size:             524288 kB
AnonHugePages:    262144 kB
"""
NUMA_MAPS = """\
7f0000000000 default file=/dev/nvidiactl mapped=262144 N0=131072 N1=131072 kernelpagesize_kB=4
7f1000000000 default file=/usr/lib/libc.so.6 mapped=1 N0=1 kernelpagesize_kB=4
7f2000000000 bind:1 anon=131072 dirty=131072 N1=131072 kernelpagesize_kB=4
"""


def test_large_mappings_have_their_bytes_per_node_and_their_huge_pages():
    pinned, anonymous = parse_large_mappings(SMAPS, NUMA_MAPS)
    assert pinned == {"bytes": 2**30, "backing": "/dev/nvidiactl", "policy": "default", "page_bytes": 4096,
                      "huge_bytes": 0, "node_bytes": {0: 2**29, 1: 2**29}}
    assert anonymous["backing"] == "[anonymous]" and anonymous["policy"] == "bind:1"
    assert anonymous["node_bytes"] == {1: 2**29} and anonymous["huge_bytes"] == 2**28
    line = summary({"cpus": [0, 1], "nodes_online": "0-1", "large_mappings": [pinned, anonymous]})
    assert line == ("host NUMA: nodes 0-1, 2 CPUs; pinned 1.0 GiB (resident GiB N0 0.5 N1 0.5, 0% huge pages); "
                    "anonymous 0.5 GiB (resident GiB N1 0.5, 50% huge pages)")


def test_hugetlb_pages_count_as_huge_whatever_their_size():
    smaps = "7f3000000000-7f3040000000 rw-s 00000000 00:0f 77                         /anon_hugepage (deleted)\n"
    numa_maps = "7f3000000000 default file=/anon_hugepage\\040(deleted) huge dirty=512 N1=512 kernelpagesize_kB=2048\n"
    (mapping,) = parse_large_mappings(smaps, numa_maps)
    assert mapping["backing"] == "/anon_hugepage (deleted)" and mapping["page_bytes"] == 2 * 2**20
    assert mapping["node_bytes"] == {1: 2**30} and mapping["huge_bytes"] == 2**30


def test_the_process_reads_its_own_record():
    record = host_numa()
    assert record["cpus"] and "large_mappings" in record
    assert summary(record).startswith("host NUMA: ")
    assert summary({"nodes_online": "0", "large_mappings": None, "error": "FileNotFoundError: x"}) == \
        "host NUMA: nodes 0, mappings not read (FileNotFoundError: x)"
    assert summary({"nodes_online": "0", "large_mappings": []}) == "host NUMA: nodes 0, no mapping of 256 MiB or more"

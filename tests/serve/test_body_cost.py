"""A body just under the 4 MiB limit, of any shape, costs under 100 MB and 0.5 s to answer (or,
on a machine too slow or busy for that, a few times what parsing that JSON alone costs there):
its size is checked before it is parsed, its shape before it becomes objects, and its text before
it is tokenized."""

import json
import re
import time
from pathlib import Path

import httpx
import pytest

NUM_BYTES = 4_000_000
MAX_PEAK_BYTES = 100 * 2**20
MAX_SECONDS = 0.5
MAX_PARSE_MULTIPLE = 4  # the answer may cost this many times a bare json.loads of the body, measured beside it
STATUS = Path("/proc/self/status")
PEAK_RESET = Path("/proc/self/clear_refs")


def _padded(head: bytes, unit: bytes, tail: bytes) -> bytes:
    return head + unit * ((NUM_BYTES - len(head) - len(tail)) // len(unit)) + tail


def _keys(head: bytes, key_format: bytes, tail: bytes) -> bytes:
    count = (NUM_BYTES - len(head) - len(tail)) // (len(key_format % 999999) + 1)
    return head + b",".join(key_format % i for i in range(count)) + tail


BODIES = {
    "a prompt of 4 MB": ("/v1/completions", _padded(b'{"model":"tiny","prompt":"', b"word ", b'"}')),
    "a chat message of 4 MB": ("/v1/chat/completions",
                               _padded(b'{"model":"tiny","messages":[{"role":"user","content":"', b"word ", b'"}]}')),
    "800,000 token ids": ("/v1/completions", _padded(b'{"model":"tiny","prompt":[', b"1000,", b"1]}")),
    "1.3 million empty objects": ("/v1/completions", _padded(b'{"model":"tiny","prompt":"hi","x":[', b"{},", b"{}]}")),
    "4 million levels of nesting": ("/v1/completions", _padded(b'{"model":"tiny","prompt":"hi","x":', b"[", b"")),
    "300,000 logit_bias entries": ("/v1/completions", _keys(b'{"model":"tiny","prompt":"hi","logit_bias":{', b'"%d":1',
                                                            b"}}")),
    "300,000 unknown parameters": ("/v1/completions",
                                   _keys(b'{"model":"tiny","prompt":"hi","max_tokens":1,', b'"k%d":1', b"}")),
    "a string of 700,000 escapes": ("/v1/completions", _padded(b'{"model":"tiny","prompt":"', b"\\u00e9", b'"}')),
}


def _parse_seconds(body: bytes) -> float:
    """The fastest of three bare parses: what this machine, as loaded as it is now, needs for the JSON alone."""
    fastest = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        try:
            json.loads(body)
        except (ValueError, RecursionError):
            pass
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", STATUS.read_text()).group(1))


@pytest.fixture(scope="module")
def client(server):
    try:
        PEAK_RESET.write_text("5")
    except OSError:
        pytest.skip("the peak resident size cannot be reset here (Linux /proc/self/clear_refs)")
    with httpx.Client(base_url=server.url, timeout=30, headers={"content-type": "application/json"}) as client:
        yield client


@pytest.mark.parametrize("name", list(BODIES))
def test_a_4_mb_body_costs_under_100_mb_and_half_a_second(client, name):
    route, body = BODIES[name]
    assert len(body) <= NUM_BYTES
    client.post(route, content=body)  # the first of a kind may fill caches; the second is measured
    PEAK_RESET.write_text("5")
    resident_kib = _kib("VmRSS")
    response = client.post(route, content=body)
    seconds = response.elapsed.total_seconds()
    peak_bytes = (_kib("VmHWM") - resident_kib) * 1024
    assert response.status_code in (200, 400), response.text
    max_seconds = max(MAX_SECONDS, MAX_PARSE_MULTIPLE * _parse_seconds(body))
    assert peak_bytes < MAX_PEAK_BYTES and seconds < max_seconds, (name, peak_bytes / 2**20, seconds, max_seconds)

"""Bounds on a JSON body that the parser itself does not keep: checked on the raw bytes before
parsing (nesting and the number of arrays and objects, which cost memory far beyond their bytes),
and on the parsed strings after (text that is not Unicode).

A 4 MiB body of ``[{},{},...]`` would become 1.4 million dicts, about 100 MB; a body of ``[[[...``
would exhaust the parser's recursion. Both are refused from the bytes first, by a vectorized scan
that tells brackets in strings from structure.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from strata.serve.errors import bad_request

MAX_JSON_DEPTH = 64
MAX_JSON_CONTAINERS = 65_536
_SCAN_CHUNK_BYTES = 1 << 18  # the scan's arrays are a few times this, whatever the body's size
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _bracket_steps() -> np.ndarray:
    steps = np.zeros(256, np.int8)
    steps[[ord("{"), ord("[")]] = 1
    steps[[ord("}"), ord("]")]] = -1
    return steps


_BRACKET_STEP = _bracket_steps()


def check_structure(raw: bytes) -> None:
    """400 for a body nested deeper than MAX_JSON_DEPTH or holding more than MAX_JSON_CONTAINERS
    arrays and objects, before anything is parsed."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_JSON_DEPTH:
        return
    num_containers, max_depth = _count_structure(raw)
    if num_containers > MAX_JSON_CONTAINERS:
        raise bad_request(f"the request body holds {num_containers:,} arrays and objects; at most "
                          f"{MAX_JSON_CONTAINERS:,} are accepted", code="invalid_json")
    if max_depth > MAX_JSON_DEPTH:
        raise bad_request(f"the request body nests arrays and objects {max_depth:,} deep; at most "
                          f"{MAX_JSON_DEPTH} levels are accepted", code="invalid_json")


def _count_structure(raw: bytes) -> tuple[int, int]:
    """(arrays and objects, deepest nesting) of the brackets outside strings, chunk by chunk,
    carrying the open string, the backslashes ending a chunk and the depth into the next."""
    num_backslashes, is_in_string, depth, num_containers, max_depth = 0, 0, 0, 0, 0
    for start in range(0, len(raw), _SCAN_CHUNK_BYTES):
        chunk = np.frombuffer(raw, np.uint8, min(_SCAN_CHUNK_BYTES, len(raw) - start), start)
        is_backslash = chunk == _BACKSLASH
        index = np.arange(len(chunk), dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(is_backslash, np.int32(-1 - num_backslashes), index))
        backslashes_before = np.empty(len(chunk), np.int32)  # a quote after an odd number is escaped
        backslashes_before[0] = num_backslashes
        backslashes_before[1:] = index[:-1] - last_other[:-1]
        is_quote = (chunk == _QUOTE) & (backslashes_before % 2 == 0)
        is_inside = (np.cumsum(is_quote, dtype=np.int32) + is_in_string) % 2  # a string's quotes count as inside
        steps = np.where(is_inside == 0, _BRACKET_STEP[chunk], 0)
        levels = np.cumsum(steps, dtype=np.int32) + depth
        num_containers += int(np.count_nonzero(steps > 0))
        max_depth = max(max_depth, int(levels.max()))
        depth, is_in_string = int(levels[-1]), int(is_inside[-1])
        num_backslashes = len(chunk) - 1 - int(last_other[-1]) if is_backslash[-1] else 0
    return num_containers, max_depth


def check_text(raw: bytes, value: Any) -> None:
    """400 for a string holding a lone UTF-16 surrogate (``"\\ud800"``): JSON lets it through as an
    escape, but it is not a character and cannot be encoded or tokenized."""
    if not _SURROGATE_ESCAPE.search(raw):  # the only way one gets in: the body is strict UTF-8
        return
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str) and not _is_encodable(item):
            raise bad_request("the request body holds a lone UTF-16 surrogate escape (such as \\ud800) in a "
                              "string; send text as valid Unicode (a surrogate pair encodes one character)",
                              code="invalid_encoding")


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

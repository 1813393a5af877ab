"""Who holds the device allocations behind given ledger charges: the warm-up's ledger check names the
holders when memory charged during the warm-up outlives it.

Numba hands out an allocation as ``OwnedPointer`` objects (``memalloc``'s ``own()``), whose memory
carries the charge it was made under (``ledger_charge``, set by ``gpu/memory.py``); device arrays keep
their pointer as ``gpu_data``, and a captured graph keeps the ones it allocated in a list. The chain of
referrers above each pointer of a charge (the array, then what holds the array) is what a reader needs
to find the leak. Walking the interpreter's objects (once, then a scan a link) costs about a second
with a model loaded, so this runs only once a check has failed.
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Collection

MAX_LISTED = 2
CHAIN_DEPTH = 5


def holders(charge_ids: Collection[int], pointer_type=None) -> list[str]:
    """One line per live owned pointer of an allocation made under one of ``charge_ids`` (at most
    ``MAX_LISTED``): its bytes, then the types of the objects holding it, nearest first, arrays with their
    shape and dtype. pointer_type: the class to look for (default: numba-cuda's ``OwnedPointer``)."""
    if pointer_type is None:
        from numba.cuda.cudadrv.driver import OwnedPointer as pointer_type
    wanted, pointers = set(charge_ids), {}
    # type(), not isinstance: isinstance asks a weakref proxy for its referent's class, and a dead one raises
    for o in gc.get_objects():
        if type(o) is pointer_type and _charge_id(o) in wanted:
            pointers.setdefault(_charge_id(o), o)  # a view's pointer shares its allocation's charge: one of them
            if len(pointers) == MAX_LISTED:
                break
    pointers = list(pointers.values())
    ignored = {id(pointers)}
    return [f"{_size(p)} bytes: " + describe_chain(referrer_chain(p, ignored)) for p in pointers]


def referrer_chain(obj, ignored: set[int], depth: int = CHAIN_DEPTH) -> list:
    """``obj``, then what refers to it, then what refers to that, up to ``depth`` links: the first referrer
    of each that is neither a frame nor in ``ignored`` (ids). A scan of every object a link."""
    chain = [obj]
    while len(chain) <= depth:
        holder = _first_referrer(chain[-1], {*ignored, id(chain), *(id(o) for o in chain)})
        if holder is None:
            break
        chain.append(holder)
    return chain


def describe_chain(chain: list) -> str:
    """A referrer chain as one line, nearest first: each object's type, an array's shape and dtype."""
    return " <- ".join(_describe(o) for o in chain)


def _first_referrer(obj, ignored: set[int]):
    """The first object referring to ``obj`` that is neither a frame nor in ``ignored`` (ids); None if none.
    The referrers' list lives only inside this call, so it is never found as a holder itself."""
    for referrer in gc.get_referrers(obj):
        if id(referrer) not in ignored and not inspect.isframe(referrer):
            return referrer
    return None


def _charge_id(pointer) -> int | None:
    try:
        return pointer._mem.ledger_charge.charge_id
    except (AttributeError, ReferenceError):  # not a charged allocation's pointer, or its memory already gone
        return None


def _size(pointer) -> int | None:
    try:
        return pointer._mem.size
    except (AttributeError, ReferenceError):
        return None


def _describe(obj) -> str:
    """The object's type, with its shape and dtype where it has them (an array), or its size (a container)."""
    name = type(obj).__qualname__
    try:
        if isinstance(obj, dict):
            return f"{name} of {len(obj)} ({', '.join(map(str, list(obj)[:4]))})"
        if isinstance(obj, (list, tuple)):
            return f"{name} of {len(obj)}"
        shape, dtype = getattr(obj, "shape", None), getattr(obj, "dtype", None)
        return f"{name} {tuple(shape)} {dtype}" if shape is not None and dtype is not None else name
    except Exception:  # noqa: BLE001 - a proxy's or a lazy object's lookup, or a key's str, may raise: the type will do
        return name

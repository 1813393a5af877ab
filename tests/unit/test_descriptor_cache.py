"""numba-cuda's memo of device-array layouts is bounded between requests (descriptor_cache). The
simulator replaces numba-cuda's ``dummyarray`` with a stand-in, so the real module is loaded from its
file here (pure Python), as the GPU runs it."""

import importlib.util
from pathlib import Path

import numba_cuda
import pytest

from strata.gpu.descriptor_cache import trim_descriptor_cache


@pytest.fixture
def layouts():
    path = Path(numba_cuda.__file__).parent / "numba" / "cuda" / "cudadrv" / "dummyarray.py"
    spec = importlib.util.spec_from_file_location("real_dummyarray", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _memo(layouts):
    return vars(layouts.Array)["from_desc"].__func__


def _made(layouts, first: int, count: int) -> list:
    """Layouts of [n, 64] float32 arrays, one per row count: a new memo entry each, as a prefill of a new
    prompt length makes."""
    return [layouts.Array.from_desc(0, (n, 64), (256, 4), 4) for n in range(first, first + count)]


def test_the_memo_is_cleared_past_its_bound_and_what_it_returned_stays_valid(layouts):
    kept = _made(layouts, 1, 50)
    assert _memo(layouts).cache_info().currsize == 50
    assert trim_descriptor_cache(50, layouts) == 0 and _memo(layouts).cache_info().currsize == 50  # at the bound
    _made(layouts, 51, 10)
    assert trim_descriptor_cache(50, layouts) == 60 and _memo(layouts).cache_info().currsize == 0
    assert kept[9].shape == (10, 64) and kept[9].strides == (256, 4)  # arrays made before keep their layouts
    assert layouts.Array.from_desc(0, (10, 64), (256, 4), 4).shape == (10, 64)  # and new ones are made


def test_a_soak_of_prompt_lengths_stays_under_the_bound(layouts):
    for request in range(40):  # ~27 new layouts a request, as on the reference model
        _made(layouts, 1000 + 27 * request, 27)
        trim_descriptor_cache(200, layouts)
        assert _memo(layouts).cache_info().currsize <= 200


def test_no_memo_no_work():
    from numba.cuda.cudadrv import dummyarray  # the simulator's stand-in under NUMBA_ENABLE_CUDASIM=1

    trim_descriptor_cache(0)  # the default module, whichever it is: a memo there is emptied, and
    assert trim_descriptor_cache(0) == 0  # nothing is left for a second trim
    assert trim_descriptor_cache(0, layouts=type("NoArray", (), {})) == 0
    if getattr(dummyarray, "Array", None) is None:
        assert trim_descriptor_cache(0) == 0

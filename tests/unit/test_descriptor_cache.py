"""numba-cuda's memo of device-array layouts is bounded between requests (descriptor_cache)."""

from numba.cuda.cudadrv import dummyarray

from strata.gpu.descriptor_cache import trim_descriptor_cache

MEMO = dummyarray.Array.__dict__["from_desc"].__func__


def _layouts(first: int, count: int) -> list:
    """Layouts of [n, 64] float32 arrays, one per row count: a new memo entry each, as a prefill of a new
    prompt length makes."""
    return [dummyarray.Array.from_desc(0, (n, 64), (256, 4), 4) for n in range(first, first + count)]


def test_the_memo_is_cleared_past_its_bound_and_what_it_returned_stays_valid():
    MEMO.cache_clear()
    kept = _layouts(1, 50)
    assert MEMO.cache_info().currsize == 50
    assert trim_descriptor_cache(max_entries=50) == 0 and MEMO.cache_info().currsize == 50  # at the bound: kept
    _layouts(51, 10)
    assert trim_descriptor_cache(max_entries=50) == 60 and MEMO.cache_info().currsize == 0
    assert kept[9].shape == (10, 64) and kept[9].strides == (256, 4)  # arrays made before keep their layouts
    assert dummyarray.Array.from_desc(0, (10, 64), (256, 4), 4).shape == (10, 64)  # and new ones are made


def test_a_soak_of_prompt_lengths_stays_under_the_bound():
    MEMO.cache_clear()
    for request in range(40):  # ~27 new layouts a request, as on the reference model
        _layouts(1000 + 27 * request, 27)
        trim_descriptor_cache(max_entries=200)
        assert MEMO.cache_info().currsize <= 200

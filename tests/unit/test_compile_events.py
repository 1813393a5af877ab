"""The compile counter over numba-cuda's compiler-lock events (raised here by hand: the simulator
compiles nothing; tests/gpu has a real kernel's)."""

import numba.cuda.core.event as ev

from strata.gpu.compile_events import COMPILE_EVENT, CompileCounter, CompileTally


def test_nested_entries_count_once_and_a_closed_counter_stops_listening():
    counter = CompileCounter().listen()
    try:
        ev.start_event(COMPILE_EVENT)
        ev.start_event(COMPILE_EVENT)  # the reentrant lock, taken again inside the first compile
        ev.end_event(COMPILE_EVENT)
        ev.end_event(COMPILE_EVENT)
        assert counter.tally.num_compiles == 1 and counter.tally.seconds >= 0
        before = counter.tally
        with ev.trigger_event(COMPILE_EVENT):
            pass
        assert counter.tally.since(before).num_compiles == 1
    finally:
        counter.close()
    with ev.trigger_event(COMPILE_EVENT):
        pass
    assert counter.tally.num_compiles == 2
    counter.close()  # a second close does nothing


def test_a_counter_that_never_listens_counts_nothing():
    counter = CompileCounter()
    with ev.trigger_event(COMPILE_EVENT):
        pass
    assert counter.tally == CompileTally()
    counter.close()


def test_a_kernel_the_kernel_cache_loads_inside_the_lock_counts_as_loaded_not_compiled():
    from strata.gpu.compile_events import LOAD_EVENT
    from strata.gpu.kernels import kernel_cache

    assert LOAD_EVENT == kernel_cache.LOAD_EVENT
    counter = CompileCounter().listen()
    try:
        with ev.trigger_event(COMPILE_EVENT):
            with ev.trigger_event(LOAD_EVENT):
                pass
        assert (counter.tally.num_compiles, counter.tally.num_loaded, counter.tally.seconds) == (0, 1, 0.0)
        with ev.trigger_event(COMPILE_EVENT):  # the next one compiles
            pass
        assert (counter.tally.num_compiles, counter.tally.num_loaded) == (1, 1)
    finally:
        counter.close()


class _FakeDispatcher:
    """A dispatcher's two attributes the name is read from (numba-cuda takes the lock under its
    ``_compile_for_args``, whose ``args`` are the launch's)."""

    def __init__(self, py_func):
        self.py_func = py_func

    def typeof_pyval(self, value):
        return f"{type(value).__name__}:{value}"

    def _compile_for_args(self, *args):
        with ev.trigger_event(COMPILE_EVENT):
            pass

    def typeof_refused(self, *args):  # typing raises: the name still comes, the compile goes on
        self.typeof_pyval = None
        self._compile_for_args(*args)


def test_each_compile_is_named_by_its_kernel_and_argument_types_and_a_request_sees_its_own():
    def scale_rows(out, x):
        pass

    counter = CompileCounter().listen()
    try:
        _FakeDispatcher(scale_rows)._compile_for_args(3, 2.5)
        before = counter.tally
        _FakeDispatcher(scale_rows)._compile_for_args(7)
        _FakeDispatcher(scale_rows).typeof_refused(1.5)
        with ev.trigger_event(COMPILE_EVENT):  # no dispatcher on the stack: the innermost Strata frame, or "?"
            pass
    finally:
        counter.close()
    qualname = scale_rows.__qualname__
    assert counter.tally.names[0] == f"{qualname}(int:3, float:2.5)"
    assert counter.tally.since(before).names == (f"{qualname}(int:7)", f"{qualname}(float)", "?")
    assert CompileTally(3, 1.0, 0, ("a", "b")).since(CompileTally(1, 0.5, 0, ("a",))).names == ("a", "b")

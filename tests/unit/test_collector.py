"""Python's collector around the engine: every pass counted and timed, the loaded model frozen out of them."""

import gc

from strata.engine.collector import CollectorTally, CollectorWatch, freeze_loaded, thaw


def test_a_watch_counts_and_times_the_passes_while_it_listens():
    watch = CollectorWatch().listen()
    try:
        before = watch.tally
        gc.collect()  # a full pass
        gc.collect(0)
        passed = watch.tally.since(before)
        assert (passed.num_passes, passed.num_full_passes) == (2, 1) and passed.seconds > 0
    finally:
        watch.close()
    closed = watch.tally
    gc.collect()
    assert watch.tally == closed and watch._on_pass not in gc.callbacks
    watch.close()  # twice: nothing left to remove


def test_listening_twice_registers_one_callback():
    watch = CollectorWatch().listen().listen()
    try:
        assert gc.callbacks.count(watch._on_pass) == 1
    finally:
        watch.close()


def test_a_tally_since_an_earlier_one_is_the_difference():
    assert CollectorTally(5, 2, 0.5).since(CollectorTally(3, 1, 0.25)) == CollectorTally(2, 1, 0.25)


def test_frozen_objects_stay_out_of_passes_until_thawed():
    thaw()
    held = [object() for _ in range(100)]
    freeze_loaded()
    try:
        assert gc.get_freeze_count() >= len(held)
    finally:
        thaw()
    assert gc.get_freeze_count() == 0

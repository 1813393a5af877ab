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
    class Held:
        pass

    thaw()
    held = Held()
    freeze_loaded()
    try:
        assert not any(obj is held for obj in gc.get_objects())  # the collector's generations do not hold it
    finally:
        thaw()
    assert gc.get_freeze_count() == 0 and any(obj is held for obj in gc.get_objects())


def test_the_ledgers_last_resort_collects_a_cycle_among_frozen_objects():
    import weakref

    from strata.gpu.block_pool import BlockPool
    from strata.gpu.ledger import VramLedger
    from strata.gpu.memory import _collect_and_reclaim

    class Node:
        pass

    thaw()
    ledger = VramLedger(2**20)
    pool = BlockPool(ledger, lambda pointer: None)
    first, second = Node(), Node()
    first.other, second.other = second, first  # a cycle: only a collection frees it
    is_first_alive = weakref.ref(first)
    freeze_loaded()
    try:
        del first, second
        gc.collect()
        assert is_first_alive() is not None  # frozen: no pass of the collector finds it
        _collect_and_reclaim(pool, 0)
        assert is_first_alive() is None and gc.get_freeze_count() > 0  # found, and the rest frozen again
    finally:
        thaw()


def test_closing_a_watch_whose_callback_was_dropped_elsewhere_is_quiet():
    # a server's engine closes at shutdown: an embedding program (or a test harness) that cleared the interpreter's
    # collector callbacks before must not turn that into a failed shutdown
    watch = CollectorWatch().listen()
    gc.callbacks.remove(watch._on_pass)
    watch.close()
    assert watch._on_pass not in gc.callbacks
    watch.listen()  # and it listens again after
    try:
        assert gc.callbacks.count(watch._on_pass) == 1
    finally:
        watch.close()

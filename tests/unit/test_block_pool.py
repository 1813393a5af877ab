"""The allocator's cache of freed device blocks, with fake pointers: reuse by size class, charges
that follow the block, and the ledger taking blocks back when a charge does not fit."""

import pytest

from strata.errors import VramBudgetError
from strata.gpu.block_pool import BlockPool, rounded_bytes
from strata.gpu.ledger import POOL_OWNER, VramLedger

MIB = 1 << 20


class FakeDriver:
    """Hands out integer pointers and records the ones freed."""

    def __init__(self):
        self.next_pointer = 0x1000
        self.freed = []

    def alloc(self, ledger, pool, owner, num_bytes):
        size_class = rounded_bytes(num_bytes)
        block = pool.take(size_class, owner, num_bytes)
        if block is None:
            block = self.next_pointer, ledger.charge(owner, num_bytes)
            self.next_pointer += size_class
        return size_class, *block

    def free(self, pointer):
        self.freed.append(pointer)


def test_sizes_round_to_512_bytes():
    assert [rounded_bytes(n) for n in (0, 1, 512, 513, 4096)] == [512, 512, 512, 1024, 4096]


def test_a_freed_block_is_reused_by_the_next_allocation_of_its_size_and_charged_to_its_new_owner():
    ledger, driver = VramLedger(64 * MIB), FakeDriver()
    pool = BlockPool(ledger, driver.free)
    size, pointer, charge = driver.alloc(ledger, pool, "activations", 3 * MIB)
    pool.put(size, pointer, charge)
    assert dict(ledger.snapshot().by_owner) == {POOL_OWNER: 3 * MIB} and pool.num_bytes == 3 * MIB
    # pooled bytes are free to whoever charges next (the loan plans with them)
    assert ledger.free_bytes == 64 * MIB and ledger.snapshot().free_bytes == 64 * MIB
    _, other, other_charge = driver.alloc(ledger, pool, "activations", 2 * MIB)  # another size: a new block
    assert other != pointer
    _, again, again_charge = driver.alloc(ledger, pool, "kv_cache", 3 * MIB - 100)
    assert again == pointer and pool.num_bytes == 0
    assert dict(ledger.snapshot().by_owner) == {"activations": 2 * MIB, "kv_cache": 3 * MIB - 100}
    ledger.discharge(again_charge)
    ledger.discharge(other_charge)
    assert driver.freed == [] and ledger.used_bytes == 0
    assert pool.reclaim() == 0  # the class emptied by the reuse is gone too


def test_a_charge_that_does_not_fit_reclaims_only_what_it_needs_largest_blocks_first():
    ledger, driver = VramLedger(16 * MIB), FakeDriver()
    pool = BlockPool(ledger, driver.free)
    blocks = [driver.alloc(ledger, pool, "activations", n * MIB) for n in (1, 2, 4, 8)]
    for size, pointer, charge in blocks:
        pool.put(size, pointer, charge)
    assert ledger.owner_bytes(POOL_OWNER) == 15 * MIB
    charge = ledger.charge("expert_cache", 5 * MIB)  # 1 MiB free: the 8 MiB block goes back
    assert driver.freed == [blocks[3][1]]
    assert dict(ledger.snapshot().by_owner) == {POOL_OWNER: 7 * MIB, "expert_cache": 5 * MIB}
    with pytest.raises(VramBudgetError, match="expert_cache"):
        ledger.charge("expert_cache", 12 * MIB)  # even with the whole cache back it does not fit
    assert pool.num_bytes == 0 and ledger.owner_bytes(POOL_OWNER) == 0
    ledger.discharge(charge)


def test_reclaim_without_a_size_empties_the_pool():
    ledger, driver = VramLedger(16 * MIB), FakeDriver()
    pool = BlockPool(ledger, driver.free)
    blocks = [driver.alloc(ledger, pool, "activations", n * MIB) for n in (1, 1, 2)]
    for block in blocks:
        pool.put(*block)
    assert pool.reclaim() == 4 * MIB
    assert len(driver.freed) == 3 and ledger.used_bytes == 0


def test_when_the_ledger_goes_its_pooled_blocks_and_later_frees_go_back_to_the_driver():
    import gc

    ledger, driver = VramLedger(16 * MIB), FakeDriver()
    pool = BlockPool(ledger, driver.free)
    pooled, live = (driver.alloc(ledger, pool, "activations", n * MIB) for n in (1, 2))
    pool.put(*pooled)
    del ledger
    gc.collect()
    assert driver.freed == [pooled[1]] and pool.ledger is None
    pool.put(*live)  # an array of the dropped engine dies after it
    assert driver.freed == [pooled[1], live[1]] and pool.num_bytes == 0

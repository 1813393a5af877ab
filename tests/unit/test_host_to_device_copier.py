"""HostToDeviceCopier's choice between batched and one-by-one DMAs, against a recording driver."""

import numpy as np
import pytest

from strata.backend import expert_arena
from strata.backend.expert_arena import HostToDeviceCopier
from strata.errors import EngineError
from strata.gpu import driver_calls


class RecordingDriver:
    """Answers each batch call with the next code of ``batch_errors`` (0 once they run out)."""

    can_copy_batch = True

    def __init__(self, batch_errors=()):
        self.batch_errors = list(batch_errors)
        self.batches: list[int] = []  # copies per batch call made
        self.singles: list[tuple[int, int, int, int]] = []

    def copy_batch(self, destinations, sources, sizes, stream) -> int:
        self.batches.append(len(sizes))
        return self.batch_errors.pop(0) if self.batch_errors else 0

    def copy_one(self, destination, source, num_bytes, stream) -> None:
        self.singles.append((destination, source, num_bytes, stream))


def _copies(num_copies):
    addresses = np.arange(num_copies, dtype=np.uint64) * 64
    return addresses + 4096, addresses, np.full(num_copies, 64, dtype=np.uint64)


@pytest.fixture
def driver(monkeypatch):
    def install(**kwargs):
        fake = RecordingDriver(**kwargs)
        monkeypatch.setattr(driver_calls, "load", lambda: fake)
        return fake
    return install


def test_batches_split_at_the_per_call_limit(driver, monkeypatch):
    monkeypatch.setattr(expert_arena, "_MAX_COPIES_PER_CALL", 4)
    fake, copier = driver(), HostToDeviceCopier()
    copier.copy(*_copies(10), stream=7)
    assert fake.batches == [4, 4, 2] and fake.singles == [] and copier.is_batch_usable is True


@pytest.mark.parametrize("refusal", expert_arena._BATCH_REFUSALS)
def test_a_refused_first_batch_copies_every_dma_one_by_one_from_then_on(driver, refusal):
    fake, copier = driver(batch_errors=[refusal]), HostToDeviceCopier()
    destinations, sources, sizes = _copies(3)
    copier.copy(destinations, sources, sizes, stream=7)
    assert copier.is_batch_usable is False and fake.batches == [3]
    assert fake.singles == [(int(d), int(s), 64, 7) for d, s in zip(destinations, sources)]
    copier.copy(destinations, sources, sizes, stream=7)
    assert fake.batches == [3] and len(fake.singles) == 6  # the batch call is not tried again


def test_a_refusal_after_batches_worked_is_an_error_not_a_fallback(driver):
    fake, copier = driver(batch_errors=[0, expert_arena._BATCH_REFUSALS[0]]), HostToDeviceCopier()
    copier.copy(*_copies(2), stream=7)
    with pytest.raises(EngineError, match="CUDA error 1"):
        copier.copy(*_copies(2), stream=7)
    assert fake.singles == []


def test_any_other_batch_error_raises(driver):
    fake, copier = driver(batch_errors=[700]), HostToDeviceCopier()
    with pytest.raises(EngineError, match="CUDA error 700; check the GPU"):
        copier.copy(*_copies(2), stream=7)
    assert fake.singles == [] and copier.is_batch_usable is None


def test_the_default_stream_copies_one_by_one(driver):
    fake, copier = driver(), HostToDeviceCopier()
    copier.copy(*_copies(2), stream=None)
    assert fake.batches == [] and [s[3] for s in fake.singles] == [0, 0]


class OrderingDriver:
    """Records the stream and event calls a CopyStream makes, in order."""

    def __init__(self):
        self.calls: list[tuple] = []
        self._num_events = 0

    def stream_create(self) -> int:
        return 99

    def event_create(self) -> int:
        self._num_events += 1
        return self._num_events

    def event_record(self, event, stream) -> None:
        self.calls.append(("record", stream))

    def stream_wait_event(self, stream, event) -> None:
        self.calls.append(("wait", stream))


class RecordingArena:
    def __init__(self, driver):
        self.driver = driver

    def stage_many(self, slots, host_slots, stream) -> None:
        self.driver.calls.append(("copy", stream, list(slots)))


@pytest.mark.parametrize("is_after_compute", [True, False])
def test_staging_waits_for_the_kernels_only_when_asked(monkeypatch, is_after_compute):
    fake = OrderingDriver()
    monkeypatch.setattr(driver_calls, "load", lambda: fake)
    stream = expert_arena.CopyStream()
    ticket = stream.stage(RecordingArena(fake), [3, 5], [None, None], is_after_compute)
    copied = [("copy", 99, [3, 5]), ("record", 99)]
    # default stream (0): the event the copy stream waits on, recorded after the kernels issued so far
    assert fake.calls == ([("record", 0), ("wait", 99)] + copied if is_after_compute else copied)
    stream.wait(ticket)
    assert fake.calls[-1] == ("wait", 0)


@pytest.mark.parametrize("view", ["whole", "row", "column", "strided", "empty", "read-only", "transposed"])
def test_host_address_is_the_address_ctypes_gives(view):
    block = np.arange(64, dtype=np.uint8).reshape(8, 8)
    read_only = np.frombuffer(bytes(16), dtype=np.uint8)
    array = {"whole": block, "row": block[3], "column": block[:, 5:], "strided": block[::2],
             "empty": np.zeros(0, dtype=np.uint8), "read-only": read_only, "transposed": block.T}[view]
    assert driver_calls.host_address(array) == array.ctypes.data

"""The warm-up's loan of what a startup loan deferred: back for the warm-up alone, then released
again; where it does not fit, nothing stays and the warm-up says what it could not compile."""

import types

from strata.engine.warmup import deferred_restored
from strata.errors import AllocationError


class Deferred:
    def __init__(self, name, fits=True):
        self.name, self.fits, self.is_resident, self.calls = name, fits, False, []

    def restore(self):
        self.calls.append("restore")
        if not self.fits:
            raise AllocationError(f"{self.name} does not fit")
        self.is_resident = True

    def release(self):
        self.calls.append("release")
        self.is_resident = False


def _engine(*resources):
    return types.SimpleNamespace(resources={r.name: r for r in resources})


def test_deferred_resources_are_back_inside_the_block_only():
    head, experts, resident = Deferred("mtp_draft_head"), Deferred("mtp_experts"), Deferred("verifier")
    resident.is_resident = True  # not deferred: left alone
    with deferred_restored(_engine(head, experts, resident), ("mtp_draft_head", "mtp_experts", "verifier"),
                           "the MTP block's prefill launches") as is_here:
        assert is_here and head.is_resident and experts.is_resident
    assert not head.is_resident and not experts.is_resident and resident.calls == []


def test_what_does_not_fit_is_released_and_the_block_is_skipped(caplog):
    head, experts = Deferred("mtp_draft_head"), Deferred("mtp_experts", fits=False)
    with deferred_restored(_engine(head, experts), ("mtp_draft_head", "mtp_experts"),
                           "the MTP block's prefill launches") as is_here:
        assert not is_here
    assert not head.is_resident and head.calls == ["restore", "release"]
    assert "the MTP block's prefill launches not compiled" in caplog.text

import pytest
from fakes import FakeEngine
from loan_setup import ALL_RESOURCES_MIB, make_config, make_host

from strata.engine.loan.admission import admit
from strata.errors import AdmissionError

RULES = [
    ({"serve": False}, "runtime.serve = False: the loan runs only on the serialized serve path; "
                       "set runtime.serve = true or set loan.enabled = false"),
    ({"vram_elastic": False}, "runtime.vram_elastic = False: the loan grows the elastic expert cache"),
    ({"vmm_segment": "32MiB"}, "runtime.vmm_segment = '32MiB': the loan needs virtual-memory segments of at least "
                               '64 MiB; set runtime.vmm_segment = "64MiB"'),
    ({"prefill_head_alias": True}, "runtime.prefill_head_alias = True: the head alias already lends"),
    ({"mtp": False, "spec_depth": 0}, "runtime.mtp = False: loan_mtp defers decode resources that exist only with MTP"),
    ({"spec_depth": 1}, "runtime.spec_depth = 1: loan_head needs MTP speculation depth >= 2"),
]


def engine_for(runtime=None, resources=ALL_RESOURCES_MIB, plugins=None):
    loan = {"plugins": plugins} if plugins is not None else {}
    host, config = make_host(make_config(runtime=runtime or {}, loan=loan))
    return FakeEngine(config, host, resources), host, config


@pytest.mark.parametrize("runtime, message", RULES)
def test_each_rule_rejects_before_anything_is_deferred(runtime, message):
    engine, host, config = engine_for(runtime)
    with pytest.raises(AdmissionError, match=message):
        admit(config, host, engine.resources)
    assert engine.history == []  # nothing released, nothing loaded


def test_the_reference_configuration_is_admitted():
    engine, host, config = engine_for()
    admit(config, host, engine.resources)


def test_every_rejection_is_reported_together():
    engine, host, config = engine_for({"serve": False, "vram_elastic": False, "prefill_head_alias": True})
    with pytest.raises(AdmissionError) as caught:
        admit(config, host, engine.resources)
    assert [r.option for r in caught.value.rejections] == ["runtime.serve", "runtime.vram_elastic",
                                                           "runtime.prefill_head_alias"]


def test_head_loan_needs_a_native_output_head():
    tied = {k: v for k, v in ALL_RESOURCES_MIB.items() if k != "output_head"}
    engine, host, config = engine_for(resources=tied, plugins=["loan_head"])
    with pytest.raises(AdmissionError, match="no native output head .*remove loan_head from loan.plugins"):
        admit(config, host, engine.resources)


def test_mtp_loan_needs_a_model_with_an_mtp_block():
    engine, host, config = engine_for(resources={"output_head": 600}, plugins=["loan_mtp"])
    with pytest.raises(AdmissionError, match="the model has no MTP block"):
        admit(config, host, engine.resources)


def test_retain_and_repeat_alone_need_no_mtp():
    engine, host, config = engine_for({"mtp": False, "spec_depth": 0}, resources={},
                                      plugins=["retain_startup_chunk", "repeat_loan"])
    admit(config, host, engine.resources)


def test_loan_off_admits_anything():
    host, config = make_host(make_config(runtime={"serve": False, "vram_elastic": False, "prefill_head_alias": True},
                                         loan={"enabled": False, "plugins": None}))
    admit(config, host, {})

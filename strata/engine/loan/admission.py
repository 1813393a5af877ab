"""Startup admission of the prefill VRAM loan: the core's rules, then every plugin's.

The loan is admitted only on the serialized, one-GPU serve path with the segmented elastic
expert cache. The reference's other refusals (batch slots, pipeline windows, layer split, helper,
remote and peer caches, HIP) are features Strata does not have: the configuration refuses them at
load whatever the loan (``strata.config``). Every rejection names the option, its value and the fix; all are
reported together and startup fails before any resource is deferred.
"""

from __future__ import annotations

from typing import Mapping

from strata.config import Config
from strata.errors import AdmissionError
from strata.hooktypes import Rejection, ResourceView
from strata.plugins import PluginHost

MIN_VMM_SEGMENT_BYTES = 64 << 20
_OFF = "or set loan.enabled = false"


def core_rejections(config: Config) -> list[Rejection]:
    rt = config.runtime
    rules = [
        (not rt.serve, "runtime.serve", rt.serve, "the loan runs only on the serialized serve path",
         f"set runtime.serve = true {_OFF}"),
        (not rt.vram_elastic, "runtime.vram_elastic", rt.vram_elastic,
         "the loan grows the elastic expert cache, which is off", f"set runtime.vram_elastic = true {_OFF}"),
        (rt.vmm_segment_bytes < MIN_VMM_SEGMENT_BYTES, "runtime.vmm_segment", f"{rt.vmm_segment_bytes >> 20}MiB",
         "the loan needs virtual-memory segments of at least 64 MiB", f'set runtime.vmm_segment = "64MiB" {_OFF}'),
        (rt.prefill_head_alias, "runtime.prefill_head_alias", rt.prefill_head_alias,
         "the head alias already lends the output head to the prompt workspace",
         f"set runtime.prefill_head_alias = false {_OFF}"),
    ]
    return [Rejection(option, value, problem, fix) for failed, option, value, problem, fix in rules if failed]


def admit(config: Config, plugins: PluginHost, resources: Mapping[str, ResourceView]) -> None:
    """Raise ``AdmissionError`` listing every rule the configuration breaks. No-op with the loan off."""
    if not config.loan.enabled:
        return
    rejections = core_rejections(config)
    for found in plugins.call("strata_loan_admit", config=config, resources=resources):
        rejections.extend(found)
    if rejections:
        raise AdmissionError(rejections)


"""Typed errors. Every message says what is wrong and what to do about it."""


class StrataError(Exception):
    """Base of every error Strata raises on purpose."""


class ConfigError(StrataError):
    """A TOML key, value or combination of options is invalid."""


class PluginError(StrataError):
    """A plugin cannot be found, loaded or validated against the hook contract."""


class AdmissionError(StrataError):
    """The loan cannot run in this configuration; raised at startup, before anything is deferred."""

    def __init__(self, rejections):
        self.rejections = tuple(rejections)
        lines = [f"  - {r}" for r in self.rejections]
        super().__init__("the prefill VRAM loan is not admitted in this configuration:\n" + "\n".join(lines))


class ModelFormatError(StrataError):
    """A GGUF file is truncated, malformed, or holds something Strata does not support."""


class NonFiniteWeightError(ModelFormatError):
    """A tensor of the model file holds NaN or infinity: the file is corrupt. Names the tensor."""

    def __init__(self, message: str, tensor_name: str):
        self.tensor_name = tensor_name
        super().__init__(message)


class StaleExpertPackError(ModelFormatError):
    """An expert pack was written from another GGUF, or by another pack format: it must be written again."""


class DeviceLockError(StrataError):
    """Another process that takes prefill VRAM loans holds this GPU; names its pid and the fix."""


class AllocationError(StrataError):
    """Device memory could not be allocated; the loan retries a smaller prefill geometry on this."""


class VramBudgetError(AllocationError):
    """An allocation would exceed the VRAM budget. Names the owner, the request and what is resident."""

    def __init__(self, owner: str, requested_bytes: int, free_bytes: int, resident_by_owner: dict):
        self.owner = owner
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes
        self.resident_by_owner = dict(resident_by_owner)
        resident = ", ".join(f"{k}={_mib(v)}" for k, v in sorted(self.resident_by_owner.items())) or "nothing"
        super().__init__(
            f"{owner} asked for {_mib(requested_bytes)} but only {_mib(free_bytes)} is free under the "
            f"VRAM budget (resident: {resident}); raise runtime.vram_budget or shrink the request"
        )


class LoanError(StrataError):
    """The loan transaction failed; every resource it released was put back before this was raised."""


class LoanRestoreError(LoanError):
    """A released resource or runtime setting could not be put back. The engine is unhealthy."""


class EngineError(StrataError):
    """The engine failed while serving a request."""


class NonFiniteLogitsError(EngineError):
    """A request's logits came out NaN or infinite: the weights or activations are not finite. Raised
    at the first such token, instead of picking a token from them; the engine stays healthy."""


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


class RequestError(StrataError):
    """A request the engine cannot take as given (a prompt longer than the context, say)."""


class PrefillCancelled(StrataError):
    """Not a failure: the request was cancelled (its client went away, or the server is stopping) between two
    prefill layers. The loan restores as after any exception, and the request ends with finish "cancelled"."""


class ExperimentError(StrataError):
    """``strata experiment`` cannot run as asked: a missing model (naming the ``strata synth`` command
    that writes it), an option the configuration cannot serve, or a run that failed."""

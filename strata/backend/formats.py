"""The tensor types each backend runs, and the refusal of a file one cannot run, tensor by tensor."""

from __future__ import annotations

from gguf import GGMLQuantizationType as QType

from strata.errors import ModelFormatError
from strata.model import quants
from strata.model.gguf_file import GgufModel

BACKENDS = ("numpy", "cuda", "cudasim")
_MAX_LISTED = 4


def runnable_types(backend: str) -> frozenset[QType]:
    """The tensor types ``backend`` computes with: numpy every type the loader reads, cuda and
    cudasim those the packed layout holds."""
    if backend in ("cuda", "cudasim"):
        from strata.gpu.kernels.packing import FORMATS

        return frozenset(QType(f.ggml_type) for f in FORMATS.values())
    return frozenset(t for t in QType if quants.is_supported(t))


def require_runnable_tensors(model: GgufModel, backend: str) -> None:
    """A ModelFormatError unless ``backend`` runs every tensor of ``model``: it names each tensor it
    cannot run with the backends that can."""
    runnable = runnable_types(backend)
    refused = [(name, ref.qtype) for name, ref in model.tensors.items() if ref.qtype not in runnable]
    if refused:
        listed = "; ".join(f"{name} is {qtype.name} (runs on {_backends_running(qtype)})"
                           for name, qtype in refused[:_MAX_LISTED])
        more = f" and {len(refused) - _MAX_LISTED} more" if len(refused) > _MAX_LISTED else ""
        raise ModelFormatError(f"{model.path}: the {backend} backend cannot run {listed}{more}; set "
                               "runtime.backend to one that runs them, or convert those tensors to a type it runs: "
                               f"{', '.join(sorted(t.name for t in runnable))}")


def _backends_running(qtype: QType) -> str:
    return ", ".join(b for b in BACKENDS if qtype in runnable_types(b)) or "no backend"

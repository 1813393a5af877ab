import dataclasses
from pathlib import Path

import pytest
from loan_setup import config_dict, make_config, make_host

from strata.config import load_config, parse_config
from strata.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_serve_toml_is_the_reference_configuration():
    config = load_config(ROOT / "configs" / "serve.toml")
    rt = config.runtime
    assert (rt.context_tokens, rt.kv_type, rt.kv_resident_cells) == (65536, "q4_0", 24576)
    assert rt.vram_budget_bytes == 8 << 30 and rt.vmm_segment_bytes == 64 << 20
    assert rt.serve and rt.vram_elastic and rt.mtp and rt.spec_depth == 4
    assert config.loan.enabled
    assert config.loan.plugins == ("loan_mtp", "loan_head", "retain_startup_chunk", "repeat_loan")
    assert config.loan.tables["repeat_loan"] == {"min_tokens": 50000}


def test_the_experiments_configuration_is_serve_toml_with_the_reference_gpus_model_paths():
    serve, experiments = (load_config(ROOT / "configs" / name) for name in ("serve.toml", "experiments-h200.toml"))
    assert experiments.runtime == serve.runtime and experiments.loan == serve.loan
    assert experiments.model.path.name == serve.model.path.name and experiments.model.expert_pack is not None


def test_config_is_frozen():
    config = make_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.runtime.serve = False


@pytest.mark.parametrize("section, key, nearest", [
    ("runtime", "vram_budgte", "runtime.vram_budget"),
    ("runtime", "kv_typ", "runtime.kv_type"),
    ("serve", "prot", "serve.port"),
    ("loan", "enable", "loan.enabled"),
])
def test_unknown_key_names_path_and_nearest_key(section, key, nearest):
    with pytest.raises(ConfigError, match=f"unknown key {section}.{key}: did you mean {nearest}"):
        parse_config(config_dict(**{section: {key: 1}}))


def test_unknown_section_names_the_valid_ones():
    data = config_dict()
    data["runtme"] = {}
    with pytest.raises(ConfigError, match="unknown key runtme: did you mean runtime"):
        parse_config(data)


@pytest.mark.parametrize("key, value, message", [
    ("kv_type", "q5_1", "runtime.kv_type = 'q5_1': allowed values are 'f16', 'q8_0', 'q4_0'"),
    ("backend", "gpu", "runtime.backend = 'gpu': allowed values are 'auto', 'cuda', 'cudasim', 'numpy'"),
    ("context_tokens", 8, r"runtime.context_tokens = 8: must be in the range \[16, 4194304\]"),
    ("serve", "yes", "runtime.serve = 'yes': expected true or false"),
    ("spec_depth", 2.5, "runtime.spec_depth = 2.5: expected an integer"),
    ("vram_budget", "8 gigs", 'runtime.vram_budget = \'8 gigs\': expected a size such as "8GiB"'),
    ("vmm_segment", True, "runtime.vmm_segment = True: expected a size"),
])
def test_bad_value_names_key_and_allowed_values(key, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(config_dict(runtime={key: value}))


@pytest.mark.parametrize("text, num_bytes", [("8GiB", 8 << 30), ("64MiB", 64 << 20), ("1.5GiB", 3 << 29),
                                             (1024, 1024), ("2GB", 2 * 10**9)])
def test_sizes(text, num_bytes):
    assert parse_config(config_dict(runtime={"vram_budget": text})).runtime.vram_budget_bytes == num_bytes


def test_repeat_threshold_under_its_minimum_is_an_error_not_a_clamp():
    with pytest.raises(ConfigError, match=r"loan.repeat_loan.min_tokens = 255: must be in the range >= 256"):
        make_host(make_config(loan={"repeat_loan": {"min_tokens": 255}}))
    _, config = make_host(make_config(loan={"repeat_loan": {"min_tokens": 256}}))
    assert config.plugin_options("repeat_loan").min_tokens == 256


def test_repeat_threshold_defaults_to_1024():
    assert make_host(make_config())[1].plugin_options("repeat_loan").min_tokens == 1024


def test_unknown_plugin_table_key():
    with pytest.raises(ConfigError, match="unknown key loan.repeat_loan.min_token: did you mean "
                                          "loan.repeat_loan.min_tokens"):
        make_host(make_config(loan={"repeat_loan": {"min_token": 2000}}))


def test_cross_field_error_names_both_options_and_the_fix():
    with pytest.raises(ConfigError, match="runtime.spec_depth = 4 needs runtime.mtp = true; set runtime.mtp = true "
                                          "or set runtime.spec_depth = 0"):
        parse_config(config_dict(runtime={"mtp": False}))
    with pytest.raises(ConfigError, match=r"runtime.decode_prefetch = true needs runtime.decode_graphs = true .*; set "
                                          "runtime.decode_graphs = true or runtime.decode_prefetch = false"):
        parse_config(config_dict(runtime={"decode_graphs": False, "decode_prefetch": True}))
    # left unset, decode_prefetch follows decode_graphs
    assert not parse_config(config_dict(runtime={"decode_graphs": False})).runtime.decode_prefetch
    assert parse_config(config_dict(runtime={})).runtime.decode_prefetch
    # misses read in place: one graph a token, nothing staged ahead
    with pytest.raises(ConfigError, match=r'runtime.decode_misses = "host" needs runtime.decode_graphs = true .*; '
                                          r'set runtime.decode_graphs = true or runtime.decode_misses = "stage"'):
        parse_config(config_dict(runtime={"decode_misses": "host", "decode_graphs": False}))
    with pytest.raises(ConfigError, match=r'runtime.decode_prefetch = true stages experts ahead, which '
                                          r'runtime.decode_misses = "host" never does .*; set '
                                          r'runtime.decode_prefetch = false or runtime.decode_misses = "stage"'):
        parse_config(config_dict(runtime={"decode_misses": "host", "decode_prefetch": True}))
    assert not parse_config(config_dict(runtime={"decode_misses": "host"})).runtime.decode_prefetch
    with pytest.raises(ConfigError, match="runtime.decode_misses"):
        parse_config(config_dict(runtime={"decode_misses": "pinned"}))
    with pytest.raises(ConfigError, match="loan.plugins .* has no effect without loan.enabled = true"):
        parse_config(config_dict(loan={"enabled": False}))


def test_plugin_listed_twice():
    with pytest.raises(ConfigError, match="loan.plugins lists loan_mtp more than once"):
        parse_config(config_dict(loan={"plugins": ["loan_mtp", "loan_mtp"]}))


def test_model_section_required_and_paths_resolve_against_the_config(tmp_path):
    (tmp_path / "a.toml").write_text('[model]\npath = "m/x.gguf"\n')
    assert load_config(tmp_path / "a.toml").model.path == tmp_path / "m" / "x.gguf"
    (tmp_path / "b.toml").write_text("[runtime]\nserve = true\n")
    with pytest.raises(ConfigError, match=r"\[model\] is required"):
        load_config(tmp_path / "b.toml")


def test_invalid_toml_and_missing_file(tmp_path):
    (tmp_path / "c.toml").write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("origins", [[], ["*"], ["http://localhost:3000", "https://app.example.com"],
                                     ["http://[::1]:8080"]])
def test_cors_origins(origins):
    assert parse_config(config_dict(serve={"cors_origins": origins})).serve.cors_origins == tuple(origins)


@pytest.mark.parametrize("origin", ["localhost:3000", "http://example.com/", "http://example.com/app", "ftp://x",
                                    "http://a b", ""])
def test_a_cors_origin_that_is_not_an_origin_names_the_key_and_the_form(origin):
    with pytest.raises(ConfigError, match=r'serve.cors_origins holds .*: each entry is an origin such as '
                                          r'"http://localhost:3000" \(scheme://host\[:port\], no path\) or "\*"'):
        parse_config(config_dict(serve={"cors_origins": [origin]}))


def test_cudasim_needs_a_vram_budget():
    with pytest.raises(ConfigError, match=r'runtime.backend = "cudasim" needs runtime.vram_budget: .*; set for '
                                          r'example vram_budget = "2GiB" under \[runtime\]'):
        parse_config(config_dict(runtime={"backend": "cudasim", "vram_budget": None}))
    assert parse_config(config_dict(runtime={"backend": "cudasim", "vram_budget": "1GiB"})).runtime.backend == "cudasim"


@pytest.mark.parametrize("is_loan", [True, False])
@pytest.mark.parametrize("key, value, feature", [
    ("batch_slots", 4, "concurrent batch sessions"),
    ("pipeline_windows", 2, "pipelined prefill windows"),
    ("layer_split", [0.5, 0.5], "splitting layers across devices"),
    ("helper_cache", True, "a helper-process expert cache"),
    ("remote_cache", "10.0.0.2:9000", "a remote expert cache"),
    ("peer_cache", True, "a peer-GPU expert cache"),
])
def test_a_feature_strata_does_not_have_is_refused_by_name_whatever_the_loan(key, value, feature, is_loan):
    loan = {} if is_loan else {"enabled": False, "plugins": None}
    with pytest.raises(ConfigError, match=f"runtime.{key} = .*: {feature}.* is not supported by Strata; "
                                          f"remove runtime.{key}"):
        parse_config(config_dict(runtime={key: value}, loan=loan))


@pytest.mark.parametrize("key, value", [("batch_slots", 0), ("pipeline_windows", 0), ("layer_split", [1.0]),
                                        ("helper_cache", False), ("remote_cache", ""), ("peer_cache", False)])
def test_the_off_value_of_a_feature_strata_does_not_have_is_accepted(key, value):
    parse_config(config_dict(runtime={key: value}))


@pytest.mark.parametrize("backend, feature", [("hip", "HIP"), ("rocm", "HIP"), ("sycl", "SYCL")])
def test_a_gpu_api_strata_does_not_have_is_refused_as_not_supported(backend, feature):
    with pytest.raises(ConfigError, match=f"runtime.backend = '{backend}': {feature}.* is not supported by Strata; "
                                          "allowed values are 'auto', 'cuda', 'cudasim', 'numpy'"):
        parse_config(config_dict(runtime={"backend": backend}))


def test_a_fixed_ring_outside_the_planners_range_names_the_keys():
    with pytest.raises(ConfigError, match=r"planner.ring_slots = 1 is outside planner.min_ring_slots = 2 \.\. "
                                          r"planner.max_ring_slots = 512"):
        parse_config(config_dict(planner={"ring_slots": 1}))
    assert parse_config(config_dict(planner={"ring_slots": 64, "chunk_tokens": 4096})).planner.ring_slots == 64


@pytest.mark.parametrize("key", ["pcie_bytes_per_s", "compute_flops_per_s"])
def test_a_rate_is_measured_by_default_fixed_when_set_and_a_tiny_one_is_refused(key):
    assert getattr(parse_config(config_dict()).planner, key) == 0  # 0: measured (probe, chunks)
    assert getattr(parse_config(config_dict(planner={key: 40e9})).planner, key) == 40e9
    with pytest.raises(ConfigError, match=rf"planner.{key} = 55 is below 1e\+06: .* or 0 to let the engine measure"):
        parse_config(config_dict(planner={key: 55}))
    with pytest.raises(ConfigError, match=rf"planner.{key} = -1"):
        parse_config(config_dict(planner={key: -1.0}))


def test_deterministic_must_be_a_boolean():
    with pytest.raises(ConfigError, match="runtime.deterministic"):
        parse_config({"model": {"path": "model.gguf"}, "runtime": {"deterministic": "yes"}})

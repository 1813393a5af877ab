"""The cache of the compiled CUDA C++ sources: one compile a text, architecture, output kind and
compiler, kept between processes; the compile is a recording fake here (NVRTC needs the CUDA toolkit's
library), the real one runs in every GPU test that links a source."""

import pytest

from strata.gpu.kernels import ptx_cache, tensor_core

PTX = b"//\n.version 9.0\n.target sm_90a\n.address_size 64\n"
VERSIONS = "numba-cuda 0.30.4, nvrtc 13.0"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "strata" / "ptx"


class RecordingCompile:
    def __init__(self):
        self.calls = []

    def __call__(self, text, label, cc, is_ltoir):
        self.calls.append((label, cc, is_ltoir))
        return PTX + f"// {label} {text[:20]}\n".encode()


def test_a_text_compiles_once_and_the_next_process_reads_its_ptx(cache):
    compile_fn = RecordingCompile()
    text = 'extern "C" __device__ void f() {}'
    first = ptx_cache.compiled_code(text, "f.cu", (9, 0, "a"), False, compile_fn, VERSIONS)
    again = ptx_cache.compiled_code(text, "f.cu", (9, 0, "a"), False, compile_fn, VERSIONS)
    assert first == again and first.startswith(PTX) and compile_fn.calls == [("f.cu", (9, 0, "a"), False)]
    assert [p.suffix for p in cache.iterdir()] == [".ptx"]  # no temporary file left beside it


@pytest.mark.parametrize("change", ["text", "cc", "is_ltoir", "versions"])
def test_another_text_architecture_output_or_compiler_compiles_again(cache, change):
    compile_fn = RecordingCompile()
    args = {"text": "int a;", "cc": (9, 0, "a"), "is_ltoir": False, "versions": VERSIONS}
    ptx_cache.compiled_code(args["text"], "a.cu", args["cc"], args["is_ltoir"], compile_fn, args["versions"])
    args[change] = {"text": "int b;", "cc": (8, 0, ""), "is_ltoir": True,
                    "versions": "numba-cuda 0.31.0, nvrtc 13.0"}[change]
    ptx_cache.compiled_code(args["text"], "a.cu", args["cc"], args["is_ltoir"], compile_fn, args["versions"])
    assert len(compile_fn.calls) == 2 and len(list(cache.iterdir())) == 2


def test_a_cut_file_is_compiled_again_and_an_unwritable_folder_only_loses_the_reuse(cache, tmp_path, monkeypatch):
    compile_fn = RecordingCompile()
    ptx = ptx_cache.compiled_code("int c;", "c.cu", (9, 0, "a"), False, compile_fn, VERSIONS)
    (kept,) = cache.iterdir()
    whole = kept.read_bytes()
    kept.write_bytes(whole[:len(ptx) // 2] + whole[-32:])  # cut, its digest kept
    assert ptx_cache.compiled_code("int c;", "c.cu", (9, 0, "a"), False, compile_fn, VERSIONS) == ptx
    assert kept.read_bytes() == whole and len(compile_fn.calls) == 2
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder's parent would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert ptx_cache.compiled_code("int c;", "c.cu", (9, 0, "a"), False, compile_fn, VERSIONS) == ptx


def test_kernels_link_for_the_architecture_numba_links_them_for():
    assert ptx_cache.link_cc((9, 0)) == (9, 0, "a") and ptx_cache.link_cc((8, 6)) == (8, 6, "")


def test_without_a_gpu_the_kernels_get_the_source_and_nothing_compiles(monkeypatch):
    if tensor_core.is_available():
        pytest.skip("a GPU links the PTX")
    monkeypatch.setattr(ptx_cache, "_nvrtc_compile", lambda *a: pytest.fail("compiled without a GPU"))
    assert type(tensor_core.cu_source("gemm_mma.cu", "// another text\n")).__name__ == "CUSource"


@pytest.mark.gpu
def test_on_the_gpu_kernels_link_the_source_compiled_as_their_link_takes_it():
    if not tensor_core.is_available():
        pytest.skip("needs a GPU with tensor cores")
    linkable = tensor_core.cu_source("attention_decode.cu")
    if ptx_cache.is_lto_link():
        assert type(linkable).__name__ == "LTOIR" and len(linkable.data) > 0
    else:
        assert type(linkable).__name__ == "PTXSource" and b".target sm_" in linkable.data


def test_the_lto_default_is_read_as_numba_cudas_jit_reads_it():
    # in a process without the simulator, whose modules stand in for the driver's
    import os
    import subprocess
    import sys

    code = ("from numba.cuda.cudadrv.driver import _have_nvjitlink; from strata.gpu.kernels import ptx_cache; "
            "print(ptx_cache.is_lto_link() == bool(_have_nvjitlink()))")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CUDA_DEBUGINFO")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["True"], done.stderr


def test_nvrtcs_log_goes_to_the_debug_log_and_other_warnings_still_reach_the_user(monkeypatch, caplog):
    import logging
    import warnings

    from numba.cuda.cudadrv import nvrtc

    def compile_with_a_log(text, label, cc, ltoir):
        warnings.warn("NVRTC log messages: x.cu(3): warning #177-D: function \"f\" was declared but never referenced")
        warnings.warn("something else", RuntimeWarning)
        return "code", None

    monkeypatch.setattr(nvrtc, "compile", compile_with_a_log)
    with caplog.at_level(logging.DEBUG, logger="strata.kernels"), warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert ptx_cache._nvrtc_compile("text", "x.cu", (9, 0, "a"), False) == "code"
    assert [str(w.message) for w in shown] == ["something else"]
    assert "warning #177-D" in caplog.text

"""The compiled kernels kept between processes: what makes two kernels one entry, what is never kept,
and entries that are cut, of another source tree or of another device. Kernels here are recording
fakes (compiling one needs a GPU); the real save and load run in tests/gpu/test_kernel_cache_device.py,
and the rebuild from numba-cuda's own classes in a process without the simulator below."""

import dataclasses
import hashlib
import os
import pickle
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from strata.gpu.kernels import kernel_cache
from strata.gpu.kernels.kernel_cache import DiskCache, Uncacheable, fingerprint

CC = (9, 0, "a")


@dataclasses.dataclass(frozen=True)
class Config:
    warps: int
    fmt: str


def factory(config, scale):
    def kernel(out):
        out[0] = scale * config.warps

    return kernel


class FakeDispatcher:  # what fingerprint reads of a Numba dispatcher
    def __init__(self, py_func, **targetoptions):
        self.py_func = py_func
        self.targetoptions = targetoptions


def test_a_fingerprint_names_values_not_objects():
    one, again = factory(Config(4, "Q4_0"), 2.0), factory(Config(4, "Q4_0"), 2.0)
    assert one is not again and fingerprint(one) == fingerprint(again)
    assert fingerprint(one) != fingerprint(factory(Config(8, "Q4_0"), 2.0))
    assert fingerprint(one) != fingerprint(factory(Config(4, "Q4_0"), 3.0))
    assert fingerprint(np.float32) != fingerprint(np.float16) and "0x" not in fingerprint(one)


def test_a_device_function_in_a_closure_is_fingerprinted_through_its_own_closure():
    def device_of(n):
        def device(x):
            return x * n

        return FakeDispatcher(device, device=True)

    def kernel_of(device):
        def kernel(out):
            out[0] = device(1)

        return FakeDispatcher(kernel, device=False)

    assert fingerprint(kernel_of(device_of(2))) == fingerprint(kernel_of(device_of(2)))
    assert fingerprint(kernel_of(device_of(2))) != fingerprint(kernel_of(device_of(3)))


def test_a_global_the_kernel_names_is_part_of_its_fingerprint(monkeypatch):
    import types

    module = types.ModuleType("fake_kernels")
    exec("WARPS = 4\ndef kernel(out):\n    out[0] = WARPS\n", module.__dict__)
    before = fingerprint(module.kernel)
    monkeypatch.setattr(module, "WARPS", 8, raising=False)
    assert fingerprint(module.kernel) != before


def test_an_object_of_unknown_identity_in_a_closure_is_not_cacheable():
    class Opaque:
        pass

    with pytest.raises(Uncacheable, match="Opaque"):
        fingerprint(factory(Opaque(), 1.0))


class FakeLibrary:
    def __init__(self, cubin_cache):
        self.name, self._entry_name = "kernel", "_Z6kernel"
        self._cubin_cache = cubin_cache
        self._max_registers, self._nvvm_options, self.needs_cudadevrt = None, {"opt": 3}, False
        self.use_cooperative, self._lto, self._linking_files = False, True, {"moe_rows.cu"}
        self.referenced_objects = {}


class FakeKernel:
    def __init__(self, library, **changes):
        self._codelibrary = library
        self.cooperative, self.entry_name, self.signature = False, "_Z6kernel", "(float32[:],)"
        self.debug, self.lineinfo, self.call_helper, self.extensions = False, False, None, []
        self.shared_memory_carveout, self.launch_config_sensitive = None, False
        vars(self).update(changes)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_cache, "_current_cc", lambda: CC)
    rebuilt = []

    def fake_rebuild(state, cc):
        if cc not in state["library"]["cubin_cache"]:
            raise ValueError("no cubin")
        rebuilt.append(state)
        return FakeKernel(FakeLibrary(state["library"]["cubin_cache"]))

    monkeypatch.setattr(kernel_cache, "rebuild", fake_rebuild)
    disk = DiskCache(FakeDispatcher(factory(Config(4, "Q4_0"), 2.0)), folder=tmp_path, environment="numba-cuda x")
    disk.rebuilt = rebuilt
    return disk


def test_a_saved_kernel_loads_with_its_cubin_and_none_of_its_linked_sources(cache):
    assert cache.load_overload("(float32[:],)", None) is None
    cache.save_overload("(float32[:],)", FakeKernel(FakeLibrary({CC: b"cubin"})))
    loaded = cache.load_overload("(float32[:],)", None)
    assert loaded._codelibrary._cubin_cache == {CC: b"cubin"}
    library = cache.rebuilt[0]["library"]
    assert library["llvm_strs"] == [] and "moe_rows.cu" not in repr(library) and library["lto"] is True
    assert cache.load_overload("(float16[:],)", None) is None  # another signature is another entry


def test_another_source_tree_compiler_or_closure_is_another_entry(cache, tmp_path, monkeypatch):
    cache.save_overload("(float32[:],)", FakeKernel(FakeLibrary({CC: b"cubin"})))
    other_closure = DiskCache(FakeDispatcher(factory(Config(8, "Q4_0"), 2.0)), folder=tmp_path,
                              environment="numba-cuda x")
    assert other_closure.load_overload("(float32[:],)", None) is None
    other_compiler = DiskCache(cache.dispatcher, folder=tmp_path, environment="numba-cuda y")
    assert other_compiler.load_overload("(float32[:],)", None) is None
    assert cache.load_overload("(float32[:],)", None) is not None
    monkeypatch.setattr(kernel_cache, "source_digest", lambda: "f" * 64)  # an edit anywhere in the package
    assert cache.load_overload("(float32[:],)", None) is not None  # this process runs the code it imported
    edited = DiskCache(cache.dispatcher, folder=tmp_path, environment="numba-cuda x")  # the next process's
    assert edited.load_overload("(float32[:],)", None) is None
    edited.save_overload("(float32[:],)", FakeKernel(FakeLibrary({CC: b"cubin"})))
    assert len(list(tmp_path.glob("*.kernel"))) == 2  # a second tree in use keeps its entries


def test_another_trees_entries_go_once_idle_for_a_week_and_a_load_keeps_them(cache, tmp_path, monkeypatch):
    cache.save_overload("(float32[:],)", FakeKernel(FakeLibrary({CC: b"cubin"})))
    (old,) = tmp_path.glob("*.kernel")
    week_ago = time.time() - kernel_cache._OTHER_TREE_MAX_IDLE_S - 60
    os.utime(old, (week_ago, week_ago))
    assert cache.load_overload("(float32[:],)", None) is not None  # a load marks it in use
    monkeypatch.setattr(kernel_cache, "source_digest", lambda: "f" * 64)
    edited = DiskCache(cache.dispatcher, folder=tmp_path, environment="numba-cuda x")
    edited.save_overload("(float32[:],)", FakeKernel(FakeLibrary({CC: b"cubin"})))
    assert old.exists()
    os.utime(old, (week_ago, week_ago))
    edited.save_overload("(float16[:],)", FakeKernel(FakeLibrary({CC: b"cubin"})))
    assert not old.exists() and len(list(tmp_path.glob("*.kernel"))) == 2  # the edited tree's two


def test_only_the_most_recently_used_other_trees_are_kept(cache, tmp_path, monkeypatch):
    entry = FakeKernel(FakeLibrary({CC: b"cubin"}))
    for num_edits, tree in enumerate("abcd"):  # four edits, each a tree of its own, used in turn
        monkeypatch.setattr(kernel_cache, "source_digest", lambda tree=tree: tree * 64)
        DiskCache(cache.dispatcher, folder=tmp_path, environment="numba-cuda x").save_overload("(float32[:],)", entry)
        (path,) = tmp_path.glob(tree * 12 + "-*")
        os.utime(path, (time.time() - 60 * (4 - num_edits),) * 2)
    assert sorted(p.name[0] for p in tmp_path.glob("*.kernel")) == ["b", "c", "d"]  # d's own and the two before


def test_a_code_objects_fingerprint_does_not_follow_its_constants_reference_counts():
    import marshal

    namespace = {}
    exec(compile("def kernel(out):\n    out[0] = 12345678.25 * 3.5\n", "kernel.py", "exec"), namespace)
    kernel = namespace["kernel"]
    before, marshalled = fingerprint(kernel), marshal.dumps(kernel.__code__)
    held = list(kernel.__code__.co_consts) * 3  # as a compile's IR holds them
    assert marshal.dumps(kernel.__code__) != marshalled  # what a key of the marshal bytes would have followed
    assert fingerprint(kernel) == before and held


def test_a_signatures_key_names_each_types_class():
    Point = type("Point", (), {})
    Other = type("Point", (), {"__module__": "elsewhere"})

    class Arg:
        def __init__(self, cls):
            self.instance_class = cls

        def __str__(self):
            return "Point(int64 x 2)"

    assert kernel_cache.signature_key((Arg(Point),)) != kernel_cache.signature_key((Arg(Other),))


def test_a_cut_entry_or_one_of_another_device_is_compiled_again_and_dropped(cache, tmp_path):
    cache.save_overload("(float32[:],)", FakeKernel(FakeLibrary({CC: b"cubin"})))
    (path,) = tmp_path.glob("*.kernel")
    path.write_bytes(path.read_bytes()[:-5])
    assert cache.load_overload("(float32[:],)", None) is None and not path.exists()
    state = pickle.dumps({"kernel": {}, "library": {"cubin_cache": {(8, 0, ""): b"cubin"}}})
    path.write_bytes(state + hashlib.sha256(state).digest())
    assert cache.load_overload("(float32[:],)", None) is None and not path.exists()


@pytest.mark.parametrize("change", [{"extensions": ["x"]}, {"debug": True}, {"launch_config_sensitive": True},
                                    {"cubin": {}}, {"device_array": True}])
def test_what_cannot_be_rebuilt_exactly_is_never_kept(cache, tmp_path, change):
    library = FakeLibrary(change.pop("cubin", {CC: b"cubin"}))
    if change.pop("device_array", False):
        library.referenced_objects = {"w": type("DeviceArray", (), {"__cuda_array_interface__": {}})()}
    cache.save_overload("(float32[:],)", FakeKernel(library, **change))
    assert list(tmp_path.glob("*.kernel")) == []


def test_a_kernel_whose_closure_cannot_be_named_is_never_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_cache, "_current_cc", lambda: CC)
    disk = DiskCache(FakeDispatcher(factory(object(), 1.0)), folder=tmp_path, environment="x")
    disk.save_overload("(float32[:],)", FakeKernel(FakeLibrary({CC: b"cubin"})))
    assert disk.load_overload("(float32[:],)", None) is None and list(tmp_path.glob("*")) == []


def test_the_source_digest_changes_with_any_kernel_source(tmp_path):
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "a.cu").write_text("x")
    (tmp_path / "b.py").write_text("y")
    (tmp_path / "notes.txt").write_text("not a source")
    before = kernel_cache.source_digest.__wrapped__(tmp_path)
    (tmp_path / "notes.txt").write_text("still not a source")
    assert kernel_cache.source_digest.__wrapped__(tmp_path) == before
    (tmp_path / "gpu" / "a.cu").write_text("x ")
    assert kernel_cache.source_digest.__wrapped__(tmp_path) != before


def test_numba_cudas_own_classes_rebuild_what_reduce_keeps():
    # the simulator replaces numba-cuda's code library: a process without it, on any machine
    script = textwrap.dedent("""
        from strata.gpu.kernels import kernel_cache
        from numba.cuda.dispatcher import _Kernel
        cc = (9, 0, "a")
        class Library:
            name, _entry_name, _cubin_cache, _max_registers, _nvvm_options = "k", "_Z1k", {cc: b"cubin"}, 64, {}
            needs_cudadevrt, use_cooperative, _lto, _linking_files, referenced_objects = False, False, True, set(), {}
        class Kernel:
            _codelibrary, cooperative, entry_name, signature = Library(), False, "_Z1k", None
            debug, lineinfo = False, False
            call_helper, extensions, shared_memory_carveout, launch_config_sensitive = None, [], None, False
        kernel_cache._current_cc = lambda: cc
        state = kernel_cache.reduce(Kernel())
        _Kernel.bind = lambda self: None  # loading the cubin needs a GPU
        kernel = kernel_cache.rebuild(state, cc)
        assert type(kernel) is _Kernel and kernel.entry_name == "_Z1k"
        assert kernel._codelibrary.get_cubin(cc) == b"cubin" and kernel._codelibrary._max_registers == 64
        print("rebuilt")
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "rebuilt" in done.stdout, done.stderr[-2000:]


def test_a_kernel_whose_state_does_not_pickle_is_compiled_and_not_kept(cache, tmp_path):
    kernel = FakeKernel(FakeLibrary({CC: b"cubin"}), call_helper=lambda: None)  # a lambda does not pickle
    cache.save_overload("(float32[:],)", kernel)
    assert list(tmp_path.glob("*")) == []

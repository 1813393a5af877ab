import pytest

from strata.bench import device_trace
from strata.bench.device_trace import GAP_FLOOR_US, format_summary, short_name, summarize

# as numba-cuda names a kernel made inside a factory function, and a module-level one
FACTORY_KERNEL = ("_ZN6cudapy6strata3gpu7kernels10gemv_multi13_gemv3_kernel12_3clocals_3e18gemv3_kernel_24241B2v7B2v1"
                  "E5ArrayIfLi2E1A7mutable7alignedEi")
MODULE_KERNEL = "_ZN6cudapy6strata3gpu7kernels4norm15rms_norm_kernelB2v3E5ArrayIfLi2E1C7mutable7alignedE"


def test_short_names_are_module_and_kernel():
    assert short_name(FACTORY_KERNEL) == "gemv_multi.gemv3_kernel"
    assert short_name(MODULE_KERNEL) == "norm.rms_norm_kernel"
    assert short_name("_ZN4cute6kernelEv") == "cute.kernel"
    assert short_name("void attention_direct<128>(float*)") == "void attention_direct<128>(float*)"
    # as the profiler names them, demangled
    assert short_name("strata::gpu::kernels::decode_route::_decode_route_kernel::_3clocals_3e::decode_route_kernel"
                      "[abi:v18][abi:cw51cXTLSUwv1sD_3d_3d](Array<float, 2, C, mutable, aligned>, float)") \
        == "decode_route.decode_route_kernel"
    assert short_name("strata::gpu::kernels::sample::_bias_kernel[abi:v119](Array<int, 1, C, mutable, aligned>)") \
        == "sample._bias_kernel"


def _kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_summary_counts_busy_time_once_and_names_the_gaps():
    events = [
        _kernel(MODULE_KERNEL, 0.0, 10.0),
        _kernel(FACTORY_KERNEL, 5.0, 10.0),  # overlaps the first: busy counts 0..15 once
        _kernel(MODULE_KERNEL, 15.0 + GAP_FLOOR_US + 1, 4.0),  # after an idle stretch
        _kernel(FACTORY_KERNEL, 15.0 + GAP_FLOOR_US + 5.5, 2.0),  # a launch's latency: no gap
        {"cat": "cuda_driver", "name": "cuGraphLaunch", "ts": 0.0, "dur": 3.0},
        {"cat": "cpu_op", "name": "aten::empty", "ts": 0.0, "dur": 99.0},
    ]
    summary = summarize(events)
    assert summary.num_kernels == 4
    assert summary.span_us == pytest.approx(15.0 + GAP_FLOOR_US + 7.5)
    assert summary.busy_us == pytest.approx(15.0 + 4.0 + 2.0)
    assert [(k.name, k.count, k.total_us) for k in summary.kernels] == [
        ("norm.rms_norm_kernel", 2, 14.0), ("gemv_multi.gemv3_kernel", 2, 12.0)]
    assert summary.gaps == [(1, pytest.approx(GAP_FLOOR_US + 1), "gemv_multi.gemv3_kernel", "norm.rms_norm_kernel")]
    assert [(c.name, c.count) for c in summary.host_calls] == [("cuGraphLaunch", 1)]
    text = format_summary("off", summary, num_tokens=2)
    assert "2 tokens, 2.0 kernels a token" in text
    assert "| norm.rms_norm_kernel | 1.0 | 7.0 | 7.0 | 66.7% |" in text
    assert "| cuGraphLaunch | 0.5 | 1.5 |" in text


def _mark(phase, ts, dur):
    return {"cat": "user_annotation", "name": device_trace.PHASE_PREFIX + phase, "ts": ts, "dur": dur}


def _launch_call(correlation, ts):
    return {"cat": "cuda_driver", "name": "cuGraphLaunch", "ts": ts, "dur": 1.0, "args": {"correlation": correlation}}


def test_the_hosts_marked_work_is_summed_by_what():
    host = device_trace.HOST_PREFIX
    events = [_kernel(MODULE_KERNEL, 0.0, 10.0),
              {"cat": "user_annotation", "name": host + "graph replay", "ts": 0.0, "dur": 300.0},
              {"cat": "user_annotation", "name": host + "graph replay", "ts": 400.0, "dur": 100.0},
              {"cat": "user_annotation", "name": host + "readback (now)", "ts": 600.0, "dur": 20.0},
              _mark("verify", 0.0, 500.0)]
    summary = summarize(events)
    assert [(w.name, w.count, w.total_us) for w in summary.host_work] == [  # by the phase whose mark holds them
        ("graph replay (in verify)", 2, 400.0), ("readback (now) (between phases)", 1, 20.0)]
    assert "verify" in [phase[0] for phase in summary.phases]
    assert not {"graph replay", "readback (now)"} & {phase[0] for phase in summary.phases}  # no phases
    text = format_summary("fixed-2", summary, num_tokens=2)
    assert "| graph replay (in verify) | 1.0 | 200.0 | 200.0 |" in text


def test_kernels_go_to_the_phase_whose_mark_holds_their_launch_call():
    # a draft launches two kernels, its verify one, and one launch falls between the marks; the kernels run
    # later on the device than their launch calls (the phase is the launch's, not the kernel's time)
    kernel = _kernel
    events = [
        _mark("draft", 0.0, 10.0), _launch_call(1, 2.0), _launch_call(2, 5.0),
        _mark("verify", 10.0, 40.0), _launch_call(3, 12.0),
        _launch_call(4, 60.0),
        {**kernel(MODULE_KERNEL, 20.0, 4.0), "args": {"correlation": 1}},
        {**kernel(MODULE_KERNEL, 24.0, 6.0), "args": {"correlation": 2}},
        {**kernel(FACTORY_KERNEL, 30.0, 15.0), "args": {"correlation": 3}},
        {**kernel(FACTORY_KERNEL, 61.0, 3.0), "args": {"correlation": 4}},
        _mark("draft", 70.0, 5.0),  # a second draft, no kernel launched inside it
    ]
    summary = summarize(events)
    assert summary.phases == [("draft", 2, 15.0, 2, 10.0), ("verify", 1, 40.0, 1, 15.0),
                              ("(outside the marks)", 0, 0.0, 1, 3.0)]
    text = format_summary("fixed", summary, num_tokens=3)
    assert "| draft | 2 | 7.5 | 1.0 | 5.0 |" in text and "| verify | 1 | 40.0 | 1.0 | 15.0 |" in text


MARKER = ("_ZN6cudapy6strata5bench12device_trace14device_markers12_3clocals_3e19phase_marker_kernelB2v1"
          "E5ArrayIiLi1E1C7mutable7alignedE")
END_MARKER = "strata::bench::device_trace::device_markers::_3clocals_3e::phase_end_kernel[abi:v2](Array<int>)"


def test_with_marker_kernels_a_phase_holds_what_the_device_ran_after_its_marker():
    # a replayed graph's kernels carry no correlation with the host's calls: the marker launched at the start of
    # each mark says where the device entered the phase; the markers are no kernels of the tables
    kernel = _kernel
    events = [
        _mark("draft", 0.0, 10.0), _launch_call(1, 1.0),
        _mark("verify", 10.0, 40.0), _launch_call(2, 11.0),
        kernel(MODULE_KERNEL, 5.0, 2.0),  # before any marker ran
        {**kernel(MARKER, 20.0, 1.0), "args": {"correlation": 1}},
        kernel(FACTORY_KERNEL, 22.0, 6.0), kernel(FACTORY_KERNEL, 28.0, 4.0),  # the draft's graph
        {**kernel(MARKER, 33.0, 1.0), "args": {"correlation": 2}},
        kernel(MODULE_KERNEL, 35.0, 20.0),  # the verify step's graph
        kernel(END_MARKER, 56.0, 1.0),
        kernel(MODULE_KERNEL, 58.0, 3.0),  # launched between the marks (a step's layers before its mark)
    ]
    summary = summarize(events)
    assert summary.num_kernels == 5 and not {"phase_marker_kernel", "phase_end_kernel"} & {
        k.name.split(".")[-1] for k in summary.kernels}
    assert summary.phases == [("draft", 1, 10.0, 2, 10.0), ("verify", 1, 40.0, 1, 20.0),
                              ("(outside the marks)", 0, 0.0, 2, 5.0)]


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no kernel"):
        summarize([{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}])


def test_arms_are_checked_before_anything_loads(tmp_path, capsys):
    with pytest.raises(SystemExit):
        device_trace.main(["--config", "x.toml", "--spec", "off,greedy", "--out", str(tmp_path)])
    assert "fixed-N (N >= 1), got 'greedy'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        device_trace.main(["--config", "x.toml", "--spec", "fixed-0", "--out", str(tmp_path)])
    assert "got 'fixed-0'" in capsys.readouterr().err


def test_without_torch_the_tool_says_what_it_needs(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import torch fails
    with pytest.raises(SystemExit):
        device_trace.main(["--config", "x.toml", "--out", str(tmp_path)])
    assert "install torch" in capsys.readouterr().err


def test_phases_are_marked_while_open_and_the_functions_restored_after(monkeypatch):
    import contextlib
    import sys
    import types

    from strata.engine.decode import device_speculation, step
    from strata.gpu import graphs

    marked = []
    profiler = types.ModuleType("torch.profiler")
    profiler.record_function = lambda name: contextlib.nullcontext(marked.append(name))
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)
    speculation = device_speculation.DeviceSpeculation
    originals = (step._launch, speculation.draft, speculation.launch_verify, speculation.launch_chained)
    monkeypatch.setattr(speculation, "draft", lambda self, *args: "drafted")
    monkeypatch.setattr(speculation, "launch_verify", lambda self, *args: "launched")
    monkeypatch.setattr(speculation, "launch_chained", lambda self, *args: "chained")
    monkeypatch.setattr(speculation, "read_verify", lambda self, *args: (0, [7]))
    monkeypatch.setattr(graphs.GraphSegment, "replay", lambda self: "replayed")
    replay = graphs.GraphSegment.replay
    with device_trace.marked_phases((lambda: marked.append("start"), lambda: marked.append("end"))):
        assert object.__new__(graphs.GraphSegment).replay() == "replayed"
        assert marked.pop() == "strata-host:graph replay"
        assert speculation.draft(None, 1, 2) == "drafted"
        device = object.__new__(speculation)
        assert device.verify(1, 2, 0, None, None, None) == ("launched", 0, [7])  # marked once, by its launch
        assert device.launch_chained(2, 40, None, None, None) == "chained"
        with pytest.raises(AttributeError):  # the real launch, marked first
            step._launch(None, None, None, None)
    assert marked == ["strata:draft", "start", "end", "strata:verify", "start", "end", "strata:chained", "start", "end",
                      "strata:plain", "start", "end"]
    assert graphs.GraphSegment.replay is replay
    monkeypatch.undo()
    assert (step._launch, speculation.draft, speculation.launch_verify, speculation.launch_chained) == originals

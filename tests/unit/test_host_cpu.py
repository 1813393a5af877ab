"""The bench's record of what the host's CPUs did over a request: /proc/stat's aggregate line read as
given here, and this process's own figures from getrusage."""

import argparse
import os

import pytest

from strata.bench import host_cpu
from strata.errors import ConfigError

# user nice system idle iowait irq softirq steal guest guest_nice
BEFORE = "cpu  1000 0 500 8000 100 0 0 0 0 0\ncpu0 10 0 5 80 1 0 0 0 0 0\n"
AFTER = "cpu  1600 0 700 8900 100 0 0 200 0 0\ncpu0 16 0 7 89 1 0 0 2 0 0\n"


def test_the_machines_busy_and_stolen_shares_come_from_the_aggregate_line():
    before, after = host_cpu.snapshot(BEFORE), host_cpu.snapshot(AFTER)
    record = host_cpu.between(before, after)
    # 600 user + 200 system busy, 900 idle, 200 stolen: of 1,900 ticks
    assert abs(record["machine_busy_share"] - 800 / 1900) < 1e-9
    assert abs(record["machine_steal_share"] - 200 / 1900) < 1e-9
    assert record["process_cpu_seconds"] >= 0 and record["involuntary_switches"] >= 0
    text = host_cpu.summary(record)
    assert "machine busy 42% of all CPUs, stolen 10.5%" in text and "involuntary switches" in text


def test_without_proc_stat_the_record_has_the_process_alone():
    record = host_cpu.between(host_cpu.snapshot("no cpu line"), host_cpu.snapshot("no cpu line"))
    assert "machine_busy_share" not in record and "machine" not in host_cpu.summary(record)
    assert record["process_cpu_share"] >= 0


def test_the_process_cpu_time_counts_this_processs_work():
    before = host_cpu.snapshot()
    total = sum(i * i for i in range(300_000))
    record = host_cpu.between(before, host_cpu.snapshot())
    assert total > 0 and record["process_cpu_seconds"] > 0 and record["wall_seconds"] > 0


def test_the_cpu_a_thread_ran_on_is_field_39_of_its_stat_line():
    # a command name with spaces and a parenthesis: the fields are counted after its closing ")"
    stat = "123 (python (x) y) R " + " ".join(str(n) for n in range(4, 39)) + " 7 0 0"
    assert host_cpu.current_cpu(stat) == 7
    assert host_cpu.current_cpu("garbage") is None
    here = host_cpu.current_cpu()
    assert here is None or here >= 0


def test_the_interpreter_probe_times_a_fixed_workload_and_the_summary_shows_it():
    seconds = host_cpu.speed_probe(num_repeats=2)
    assert 0 < seconds < 5
    record = host_cpu.between(host_cpu.snapshot(BEFORE), host_cpu.snapshot(AFTER))
    record.update(probe_seconds=(0.0031, 0.0062), cpus=(3, None))
    assert "interpreter probe 3.10 / 6.20 ms before / after, on CPU 3 / ?" in host_cpu.summary(record)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning a thread needs Linux")
def test_each_cpu_is_probed_and_the_thread_runs_anywhere_it_could_after():
    allowed = os.sched_getaffinity(0)
    speeds = host_cpu.cpu_speeds(num_repeats=1)
    assert set(speeds) == allowed and all(seconds > 0 for seconds in speeds.values())
    assert os.sched_getaffinity(0) == allowed
    assert "over %d CPUs" % len(allowed) in host_cpu.speeds_summary(speeds)


def test_after_the_probes_the_thread_is_put_back_on_the_cpu_it_started_on(monkeypatch):
    pinned = []
    monkeypatch.setattr(host_cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(host_cpu.os, "sched_setaffinity", lambda pid, cpus: pinned.append(set(cpus)), raising=False)
    monkeypatch.setattr(host_cpu, "current_cpu", lambda: 1)
    monkeypatch.setattr(host_cpu, "speed_probe", lambda num_repeats: 0.004)
    assert host_cpu.cpu_speeds() == {0: 0.004, 1: 0.004, 2: 0.004, 3: 0.004}
    assert pinned == [{0}, {1}, {2}, {3}, {1}, {0, 1, 2, 3}]  # the last probe's CPU is not where it stays


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning a thread needs Linux")
def test_pinning_takes_the_fastest_probe_or_the_cpu_named():
    allowed = os.sched_getaffinity(0)
    slowest_first = {cpu: 1.0 / (1 + i) for i, cpu in enumerate(sorted(allowed))}
    try:
        assert host_cpu.pin("any", slowest_first) is None and os.sched_getaffinity(0) == allowed
        fastest = max(allowed)
        assert host_cpu.pin("fastest", slowest_first) == fastest and os.sched_getaffinity(0) == {fastest}
        os.sched_setaffinity(0, allowed)
        assert host_cpu.pin(str(min(allowed)), {}) == min(allowed)
        os.sched_setaffinity(0, allowed)
        with pytest.raises(ConfigError, match="may run on CPUs"):
            host_cpu.pin(str(max(allowed) + 1), {})
    finally:
        os.sched_setaffinity(0, allowed)


def test_the_host_cpu_choice_is_checked_where_it_is_parsed():
    assert [host_cpu.choice(text) for text in ("any", "fastest", "3")] == ["any", "fastest", "3"]
    with pytest.raises(argparse.ArgumentTypeError, match="choose any, fastest or a CPU number"):
        host_cpu.choice("slowest")
    with pytest.raises(argparse.ArgumentTypeError):
        host_cpu.choice("²")


def test_thread_seconds_reads_each_threads_user_and_system_ticks(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    for tid, name, utime, stime in ((100, "python3", 3 * ticks, ticks), (101, "cuda-EvtHandlr", ticks // 2, 0)):
        task = tmp_path / str(tid)
        task.mkdir()
        # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
        (task / "stat").write_text(f"{tid} ({name}) S 1 1 1 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0\n")
        (task / "comm").write_text(name + "\n")
    (tmp_path / "102").mkdir()  # a thread that ended between the listing and the reads
    assert host_cpu.thread_seconds(tmp_path) == {100: ("python3", 4.0), 101: ("cuda-EvtHandlr", 0.5)}
    assert host_cpu.thread_seconds(tmp_path / "missing") == {}


def test_a_busy_helper_thread_is_named_in_the_record():
    import threading
    import time

    spun, release = threading.Event(), threading.Event()

    def spin(seconds=0.15):  # then stays alive: an ended thread's times leave /proc with it
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()

    before = host_cpu.snapshot()
    helper = threading.Thread(target=spin)
    helper.start()
    spun.wait()
    try:
        record = host_cpu.between(before, host_cpu.snapshot())
    finally:
        release.set()
        helper.join()
    if not record["thread_seconds"] and not os.path.isdir("/proc/self/task"):
        pytest.skip("no per-thread CPU times here (not Linux)")
    helpers = {name: s for name, s in record["thread_seconds"].items() if not name.endswith(f"[{os.getpid()}]")}
    assert helpers and max(helpers.values()) >= 0.1
    assert "; threads: " in host_cpu.summary(record)

from strata.engine.planning.planner import Geometry
from strata.engine.request import RequestStats


def _stats(**fields) -> RequestStats:
    base = dict(prompt_tokens=100, unread_tokens=100, generated_tokens=11, geometry=Geometry(512, 64),
                prefill_seconds=0.5, decode_seconds=0.25, streamed_bytes=3 * 2**20, num_chunks=1, cache_hits=30,
                cache_misses=10, loan=None, finish_reason="length")
    return RequestStats(**{**base, **fields})


def test_the_timing_line_reports_rates_hit_rate_and_how_many_prefetches_were_used():
    line = _stats(prefetched_experts=12, prefetched_used_experts=9).timing_line()
    assert "PP 200.0 tok/s, TG 40.0 tok/s" in line  # 10 decode steps: the first token is prefill's
    assert "expert-cache hit rate 75.0% (12 prefetched, 9 used)" in line
    assert line.endswith("| loan off")


def test_the_timing_line_leaves_out_prefetch_when_decode_staged_nothing_ahead():
    assert "prefetched" not in _stats().timing_line()


def test_the_timing_line_splits_decode_into_the_hosts_waits_and_its_own_work():
    # 10 decode steps in 0.25 s, 0.2 s of it blocked on the device: 20 ms a step waiting, 5 busy
    line = _stats(decode_wait_seconds=0.2).timing_line()
    assert "| decode host: waiting 20.0 ms/token, busy 5.0 |" in line
    assert "decode host" not in _stats().timing_line()  # plain launches: not measured



def test_the_timing_line_gives_the_hosts_launch_time_a_verify_step_where_speculation_ran_on_the_device():
    speculating = dict(is_speculative=True, spec_rounds=4, spec_drafted=8, spec_accepted=6, spec_depth=2)
    line = _stats(**speculating, spec_launch_seconds=0.002).timing_line()
    assert "| spec drafted 8, accepted 6 (75%), depth 2, launches 0.50 ms a verify step |" in line
    assert "launches" not in _stats(**speculating).timing_line()  # on the host: nothing launched ahead


def test_the_timing_line_names_compilations_inside_the_request_only_when_there_were_some():
    assert "compiled" not in _stats().timing_line()
    assert "| compiled 3 time(s) in 5.80 s | loan off" in _stats(num_compiles=3, compile_seconds=5.8).timing_line()
def test_a_readback_the_host_waits_on_counts_as_waiting():
    import time

    from strata.engine.stream_stats import StreamStats

    stats = StreamStats()
    assert stats.waited(lambda a, b: (time.sleep(0.01), a + b)[1], 2, 3) == 5
    assert stats.decode_wait_seconds >= 0.01

"""scripts/load.py, the load generator: its arithmetic against hand-worked numbers and numpy, its Poisson
schedule, its mixes, and one small open-loop run against a server started here (every request answered, the
visual tokens each picture size must give, the client's TTFT no shorter than the server's own); and the soak's
memory summary (scripts/soak_serve.py) on a hand-made curve."""

import asyncio
import random
import sys
from pathlib import Path

import numpy
import pytest

from nanomm import LLM
from nanomm.serve.app import BackgroundServer, Server, ServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import load  # noqa: E402  (scripts/load.py)


def test_percentile_interpolates_like_numpy():
    assert load.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert load.percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)  # rank 2.85: 3 + 0.85
    assert load.percentile([7.0], 99) == 7.0 and load.percentile([], 50) is None
    rng = random.Random(0)
    for n in (2, 5, 17, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 37, 50, 95, 99, 100):
            assert load.percentile(values, q) == pytest.approx(numpy.percentile(values, q), rel=1e-12)


def test_poisson_arrivals_have_the_rate_s_mean_gap_and_scale_with_it():
    times = load.poisson_arrivals(4.0, 20_000, random.Random(1))
    gaps = numpy.diff(times)
    assert times[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)  # 1 / rate
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: the std equals the mean
    doubled = load.poisson_arrivals(8.0, 100, random.Random(1))
    assert doubled == pytest.approx([t / 2 for t in times[:100]])  # one seed: the same pattern, twice as fast


def test_mixes_parse_and_bad_ones_say_what_is_wrong():
    assert load.parse_mix("1x224x168:3,2x56x56:1") == [load.MixEntry(1, 224, 168, 3.0), load.MixEntry(2, 56, 56, 1.0)]
    assert load.parse_mix("text") == [load.MixEntry(0, 0, 0, 1.0)]
    assert {e.num_images for e in load.parse_mix("scans")} == {1, 2}
    for bad in ("1x224:1", "photos", "1x224x224", "axbxc:1"):
        with pytest.raises(ValueError, match="COUNTxWIDTHxHEIGHT:WEIGHT"):
            load.parse_mix(bad)
    for bad in ("-1x224x224:1", "1x224x224:0", "1x10x224:1"):
        with pytest.raises(ValueError, match="count must be >= 0"):
            load.parse_mix(bad)


def record(sent, first, finished, tokens=5, visual=10, error=None):
    return load.RequestRecord(sent, 1, first, finished, 20, visual, tokens, error)


def test_summary_figures_from_hand_made_requests():
    records = [record(0.0, 0.2, 1.0), record(1.0, 1.5, 2.0, visual=30), record(2.0, 4.0, 6.0),
               record(3.0, None, None, error="HTTP 503: full")]
    s = load.summarize(records, rate=1.0, slo_ttft_s=0.6)
    assert (s["requests"], s["completed"], s["errors"]) == (4, 3, 1)
    assert s["first_errors"] == ["HTTP 503: full"]
    assert s["duration_s"] == 6.0  # the first send (0) to the last answer (6)
    assert s["arrival_rate"] == 1.0  # 3 gaps in 3 s
    assert s["ttft_s"]["p50"] == pytest.approx(0.5) and s["ttft_s"]["p99"] == pytest.approx(1.97)  # of 0.2, 0.5, 2
    assert s["tpot_s"]["p50"] == pytest.approx(0.2)  # of 0.8 / 4, 0.5 / 4 and 2 / 4: the 4 tokens after the first
    assert s["within_slo"] == 2 and s["slo_attainment"] == 0.5  # the failed request misses the SLO too
    assert s["goodput_rps"] == pytest.approx(2 / 6) and s["throughput_rps"] == pytest.approx(3 / 6)
    assert s["visual_tokens"] == 50 and s["served_visual_tokens_per_s"] == pytest.approx(50 / 6)
    assert s["offered_visual_tokens_per_s"] == pytest.approx(50 / 3)  # arrival rate x visual tokens per request


def test_mean_stages_is_the_mean_over_the_requests_between_two_reads():
    before = {"encode": (1.0, 2.0), "queue": (0.5, 2.0)}
    after = {"encode": (4.0, 5.0), "queue": (0.5, 2.0), "prefill": (0.9, 3.0)}
    assert load.mean_stages(before, after) == {"encode": 1.0, "queue": None, "prefill": pytest.approx(0.3)}


@pytest.mark.slow
def test_an_open_loop_run_against_a_server(ckpt):
    # 224x224 is 16 x 16 patches of 14 pixels, merged 2 x 2: 64 visual tokens; a 112x112 picture is 16; no picture 0.
    expected_visual = {(1, 224): 64, (2, 112): 32, (0, 0): 0}
    llm = LLM(str(ckpt), device="cpu", dtype="float32")
    mix = load.parse_mix("1x224x224:1,2x112x112:1,0x0x0:1")
    with BackgroundServer(Server(llm, ServerConfig("load"))) as base:
        before = load.ttft_stage_sums(base)
        records = asyncio.run(load.run_load(base, "load", mix, rate=20.0, num_requests=12, max_tokens=5,
                                            seed=0, content_seed=1))
        stages = load.mean_stages(before, load.ttft_stage_sums(base))
    assert [r.error for r in records] == [None] * 12
    entries = random.Random(1).choices(mix, weights=[e.weight for e in mix], k=12)  # the run's own draw
    assert [r.num_images for r in records] == [e.num_images for e in entries]
    assert [r.visual_tokens for r in records] == [expected_visual[e.num_images, e.width] for e in entries]
    assert {r.completion_tokens for r in records} == {5}  # ignore_eos: every answer is max_tokens long
    assert all(r.sent_at < r.first_token_at <= r.finished_at for r in records)
    server_ttft = stages.pop("ttft")
    assert sum(stages.values()) == pytest.approx(server_ttft, rel=1e-6)  # the stages add up to TTFT
    client_ttft = sum(r.ttft_s for r in records) / len(records)
    assert client_ttft >= server_ttft  # the client's clock starts before the server's, and stops after
    assert load.summarize(records, 20.0, slo_ttft_s=60.0)["within_slo"] == 12


def test_the_soak_s_memory_summary_from_a_hand_made_curve():
    import soak_serve  # scripts/soak_serve.py

    curve = [(0.0, 100.0), (1.0, 150.0), (2.5, 160.0), (3.0, 170.0), (4.0, 176.0)]
    summary = soak_serve.memory_summary(curve, seconds=4.0)
    assert summary["rss_mib_start"] == 100.0
    assert summary["rss_mib_peak_by_quarter"] == [150.0, 150.0, 170.0, 176.0]  # [0, 1], [1, 2], [2, 3], [3, 4]
    assert summary["rss_growth_second_half_pct"] == pytest.approx(100 * (176 - 150) / 150, abs=0.01)
    assert summary["rss_mib_peak_by_tenth"][1] is None  # no sample between 0.4 s and 0.8 s


def test_a_trace_run_against_a_server_sends_each_phase_s_mix_and_answer_length(ckpt, monkeypatch):
    """`--trace`: one run, summarized per phase; each phase's requests carry its pictures and its answer length."""
    tiny = (load.Phase("text", 1.0, 8.0, 8.0, "0x28x28:1", 3), load.Phase("pictures", 1.0, 4.0, 8.0, "1x224x224:1", 6))
    monkeypatch.setitem(load.TRACES, "tiny", tiny)
    llm = LLM(str(ckpt), device="cpu", dtype="float32")
    with BackgroundServer(Server(llm, ServerConfig("load"))) as base:
        args = load.parse_args(["--url", base, "--trace", "tiny", "--seed", "2", "--slo-ttft", "60"])
        results = load.run_trace(base, args, lambda line: None)
    assert [r["phase"] for r in results] == ["text", "pictures"]
    expected = load.trace_schedule(tiny, seed=2)
    for result, phase, visual, answer in zip(results, tiny, (0, 64), (3, 6)):
        records = result["records"]
        assert len(records) == sum(a.phase == phase.name for a in expected) == result["completed"] > 0
        assert {r["visual_tokens"] for r in records} == {visual} and {r["completion_tokens"] for r in records} == {answer}

"""nanomm/sim/stages.py, the stage model, and the one topology grammar (nanomm/topology.py): expected values are worked out by hand from the cost model, not read off the
simulator (except where a property, like monotonicity or determinism, is the point)."""

import json
import math

import pytest

from nanomm.bench import cli, simulate as simulate_cli
from nanomm.inputs.image import smart_resize
from nanomm.sim import stages as sim
from nanomm.sim.stages import StageCosts
from nanomm.topology import Topology, parse_topology, topology_of
from nanomm.sim.workload import SimRequest, make_requests, parse_mix, visual_tokens

# Round numbers, so every expected time below is a sum you can check on paper.
COSTS = StageCosts(encode_s_per_visual_token=0.001, encode_s_per_image=0.01, prefill_s_per_token=0.0001,
                   step_overhead_s=0.002, decode_s_per_step=0.005, decode_s_per_sequence=0.001,
                   visual_bytes_per_token=500, kv_bytes_per_token=1000, link_bytes_per_s=1e6, link_latency_s=0.003)
ENCODE = 0.01 + 64 * 0.001  # one 224x224 image: 64 visual tokens
PREFILL = 128 * 0.0001  # 64 text + 64 visual tokens
DECODE_STEP_1 = 0.002 + 0.005 + 1 * 0.001  # overhead + a decode step with one sequence
GENEROUS = dict(slo_ttft_s=100.0, slo_tpot_s=100.0)


def one_image_request(arrival_s=1.0, output_tokens=5, rid=0):
    return SimRequest(rid, arrival_s, (64,), text_tokens=64, output_tokens=output_tokens)


def run_one(topology, request=None, **kwargs):
    result = sim.simulate(topology, COSTS, [request or one_image_request()], **GENEROUS, **kwargs)
    return result.ttft_s[0], result.tpot_s[0]


@pytest.mark.parametrize("width, height, tokens", [
    (224, 224, 64),  # 8x8 tokens
    (448, 448, 256),  # 16x16
    (1344, 1344, 2304),  # 48x48
    (1000, 500, 648),  # 1000/28 = 35.7 -> 36, 500/28 = 17.9 -> 18: 36 * 18
    (56, 56, 4),  # exactly min_pixels
])
def test_visual_tokens_by_hand(width, height, tokens):
    assert visual_tokens(width, height) == tokens


def test_max_pixels_scales_down():
    # 448x448 is 4x the 224x224 budget: beta = 2, each side floor(448 / 2 / 28) * 28 = 224.
    assert smart_resize(448, 448, max_pixels=224 * 224) == (224, 224)
    assert visual_tokens(448, 448, max_pixels=224 * 224) == 64


@pytest.mark.parametrize("name, topology", [
    ("integrated", Topology(0, 1)), ("dp1", Topology(0, 1)), ("dp4", Topology(0, 4)), ("1e3pd", Topology(1, 3)),
    ("1e1p1d", Topology(1, 1, 1)), ("2e2p1d", Topology(2, 2, 1)), ("DP2", Topology(0, 2)), ("12e1p3d", Topology(12, 1, 3)),
])
def test_the_topology_grammar(name, topology):
    assert parse_topology(name) == topology
    assert parse_topology(topology.name) == topology  # a name round-trips
    assert topology_of(topology.shape, topology.sizes) == topology


def test_the_topology_grammar_names_itself_in_its_errors():
    for bad in ("e+pd", "epd", "1e1p", "dp0", "0e1pd", "1e0p1d", "1e1p0d", "dp", "integrated2", "1e1pd1d", ""):
        with pytest.raises(ValueError, match=r"integrated, dp<N>, <X>e<Y>pd or <X>e<Y>p<Z>d"):
            parse_topology(bad)
    assert parse_topology("dp1").name == "integrated" and parse_topology("1e3pd").pools == {"encode": 1, "lm": 3}
    assert parse_topology("2e3p4d").pools == {"encode": 2, "prefill": 3, "decode": 4} and parse_topology("2e3p4d").gpus == 9


def test_integrated_one_request():
    ttft, tpot = run_one("integrated")
    assert ttft == pytest.approx(0.002 + ENCODE + PREFILL)  # one step: overhead, the encode, the whole prompt
    assert tpot == pytest.approx(DECODE_STEP_1)


def test_integrated_chunked_prefill():
    # Budget 100: step 1 encodes and prefills 100 tokens, step 2 the other 28.
    ttft, _ = run_one("integrated", token_budget=100)
    assert ttft == pytest.approx((0.002 + ENCODE + 100 * 0.0001) + (0.002 + 28 * 0.0001))


def test_integrated_mixes_a_prefill_into_a_decode_step():
    # Both arrive at t=0; the first arrival starts a step alone. Step 2 decodes request 0 and prefills request 1.
    requests = [one_image_request(0.0, rid=0), one_image_request(0.0, rid=1)]
    step1 = 0.002 + ENCODE + PREFILL
    step2 = 0.002 + ENCODE + PREFILL + 0.005 + 1 * 0.001
    batch2 = 0.002 + 0.005 + 2 * 0.001
    one = sim.simulate("integrated", COSTS, requests, **GENEROUS)
    assert one.ttft_s == pytest.approx([step1, step1 + step2])
    # 5 tokens: request 0 gets tokens 2-5 in steps 2-5; request 1 tokens 2-5 in steps 3-6 (step 6 alone).
    assert one.tpot_s == pytest.approx([(step2 + 3 * batch2) / 4, (3 * batch2 + DECODE_STEP_1) / 4])
    two = sim.simulate("dp2", COSTS, requests, **GENEROUS)
    assert two.ttft_s == pytest.approx([step1] * 2)  # one each
    assert two.tpot_s == pytest.approx([DECODE_STEP_1] * 2)


def test_e_pd_one_request_adds_the_visual_transfer():
    ttft, tpot = run_one("1e1pd")
    visual_link = 64 * 500 / 1e6 + 0.003
    assert ttft == pytest.approx((0.002 + ENCODE) + visual_link + (0.002 + PREFILL))
    assert tpot == pytest.approx(DECODE_STEP_1)


def test_epd_one_request_adds_both_transfers():
    ttft, tpot = run_one("1e1p1d")
    visual_link, kv_link = 64 * 500 / 1e6 + 0.003, 128 * 1000 / 1e6 + 0.003
    assert ttft == pytest.approx((0.002 + ENCODE) + visual_link + (0.002 + PREFILL) + kv_link)
    assert tpot == pytest.approx(DECODE_STEP_1)


def test_text_only_request_skips_the_encoders():
    text_only = SimRequest(0, 0.0, (), text_tokens=64, output_tokens=1)
    result = sim.simulate("1e1pd", COSTS, [text_only], **GENEROUS)
    assert result.ttft_s == pytest.approx([0.002 + 64 * 0.0001])
    assert result.tpot_s == [0.0]  # one output token: no decode step
    assert result.utilisation["encode"] == 0.0


def test_slo_share_counts_both_slos():
    ttft = 0.002 + ENCODE + PREFILL
    just_in = sim.simulate("integrated", COSTS, [one_image_request()], ttft + 1e-9, DECODE_STEP_1 + 1e-9)
    ttft_out = sim.simulate("integrated", COSTS, [one_image_request()], ttft - 1e-6, 1.0)
    tpot_out = sim.simulate("integrated", COSTS, [one_image_request()], 1.0, DECODE_STEP_1 - 1e-6)
    assert (just_in.share_within_slo, ttft_out.share_within_slo, tpot_out.share_within_slo) == (1.0, 0.0, 0.0)
    assert just_in.goodput_rps == pytest.approx(1 / 1.0)  # one good request, the only arrival at t=1


def test_make_requests_is_seeded_poisson():
    a = make_requests("1x224x224:1,0x0x0:1", rate=4.0, num_requests=400, seed=3)
    assert a == make_requests("1x224x224:1,0x0x0:1", rate=4.0, num_requests=400, seed=3)
    assert a != make_requests("1x224x224:1,0x0x0:1", rate=4.0, num_requests=400, seed=4)
    assert {r.image_tokens for r in a} == {(64,), ()}
    gaps = [b.arrival_s - a_.arrival_s for a_, b in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 4.0, rel=0.15)
    with pytest.raises(ValueError, match="COUNTxWIDTHxHEIGHT"):
        parse_mix("2x224:1")


def test_goodput_equals_rate_when_the_load_is_light():
    requests = make_requests("1x448x448:1", rate=1.0, num_requests=200, seed=0)
    result = sim.simulate("1e1p1d", StageCosts.for_gpu(), requests, slo_ttft_s=10.0, slo_tpot_s=10.0)
    assert result.share_within_slo == 1.0
    assert result.goodput_rps == pytest.approx(200 / requests[-1].arrival_s)  # every arrival, over the span
    assert result.goodput_rps == pytest.approx(1.0, rel=0.15)


@pytest.mark.parametrize("name_for", [lambda d: f"2e2p{d}d", lambda d: f"2e{d}pd"])
def test_more_decode_workers_never_lower_goodput(name_for):
    requests = make_requests("1x448x448:1", rate=300.0, num_requests=300, seed=0)
    costs = StageCosts.for_gpu("qwen2-vl-2b", "h200")
    goodputs = [sim.simulate(name_for(d), costs, requests, 0.5, 0.0015).goodput_rps for d in range(1, 6)]
    assert goodputs == sorted(goodputs) and goodputs[0] < goodputs[-1]


def test_search_gives_an_encoder_heavy_mix_more_encoders():
    # Encoding costs 1 s per request and everything else ~ms: at 2.5 requests/s the encoders carry 2.5 s of work
    # per second, so 2 encoders fall behind without bound (TTFT >> 3 s) and 3 is the least that can keep up,
    # while one prefill and one decode worker are nearly idle.
    costs = StageCosts(0.0, 1.0, 1e-6, 1e-4, 1e-3, 1e-4, 10, 10, 1e9, 1e-4)
    requests = make_requests("1x224x224:1", rate=2.5, num_requests=200, seed=0)
    best = sim.search_pools("<X>e<Y>p<Z>d", costs, requests, slo_ttft_s=3.0, slo_tpot_s=1.0, max_workers=8)
    assert best.pools["prefill"] == best.pools["decode"] == 1
    assert best.pools["encode"] >= 3 and best.share_within_slo >= 0.9
    assert sim.search_pools("<X>e<Y>p<Z>d", costs, requests, 3.0, 1.0, max_workers=4) is None  # at most 2 encoders
    integrated = sim.search_pools("dp<N>", costs, requests, 3.0, 1.0, max_workers=8)
    assert integrated.pools["worker"] >= 3


def test_compositions():
    assert sim.compositions(4, 3) == [(1, 1, 2), (1, 2, 1), (2, 1, 1)]
    assert sim.compositions(2, 1) == [(2,)]


def test_for_gpu_derives_costs_from_flops_and_bytes():
    h200 = StageCosts.for_gpu("qwen2-vl-2b", "h200")
    assert h200.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2 == 28_672
    assert h200.visual_bytes_per_token == 1536 * 2
    assert h200.prefill_s_per_token == pytest.approx(2 * 1.5e9 / (989e12 * 0.5))
    assert h200.encode_s_per_visual_token == pytest.approx(2 * 675e6 * 4 / (989e12 * 0.5))
    assert h200.decode_s_per_step == pytest.approx(1.5e9 * 2 / (4.8e12 * 0.8))
    a100, l4 = StageCosts.for_gpu("qwen2-vl-2b", "a100"), StageCosts.for_gpu("qwen2-vl-2b", "l4")
    for name in ("prefill_s_per_token", "encode_s_per_visual_token", "decode_s_per_step"):
        assert getattr(h200, name) < getattr(a100, name) < getattr(l4, name)


def test_cli_runs_and_writes_json(tmp_path, capsys):
    out, costs_file = tmp_path / "sim.json", tmp_path / "costs.json"
    cli.run(simulate_cli, ["--rate", "5", "20", "--num-requests", "30", "--save-costs", str(costs_file), "--json", str(out)])
    report = json.loads(out.read_text())
    assert [(r["rate"], r["topology"]) for r in report["results"]] == \
        [(rate, t) for rate in (5.0, 20.0) for t in ("dp3", "1e2pd", "1e1p1d")]
    assert all(0 <= r["share_within_slo"] <= 1 and r["requests"] == 30 for r in report["results"])
    assert "1e1p1d" in capsys.readouterr().out
    assert StageCosts.from_json(str(costs_file)) == StageCosts.for_gpu()

    cli.run(simulate_cli, ["--costs", str(costs_file), "--search", "--max-workers", "4", "--rate", "5",
                           "--num-requests", "20", "--shapes", "dp<N>", "<X>e<Y>p<Z>d", "--json", str(out)])
    found = json.loads(out.read_text())["results"]
    assert [r["topology"] for r in found] == ["integrated", "1e1p1d"]
    assert found[0]["pools"] == {"worker": 1} and found[1]["pools"] == {"encode": 1, "prefill": 1, "decode": 1}
    assert not any(math.isnan(r["ttft_p90_s"]) for r in found)

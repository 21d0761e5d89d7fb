"""nanomm/sim/twin.py, the simulator's engine-faithful mode: expected times are sums worked out by hand from a
device with round costs (RoundDevice), and the scheduling rules are nanomm's own (engine/scheduler.py)."""

from dataclasses import dataclass

import pytest

from nanomm.sim import twin as se
from nanomm.topology import parse_topology
from nanomm.sim.twin import EngineLimits, HostCosts, TwinCosts
from nanomm.sim.workload import SimRequest


@dataclass
class Shape:
    visual_token_bytes: int = 1000
    kv_bytes_per_token: int = 100


class RoundDevice:
    """A step: 1 ms + 10 us a new token; an encode: 100 ms + 1 us a patch, one call per step; a link: 1 ms + 1 ns
    a byte."""
    shape = Shape()

    def __init__(self):
        self.steps, self.encodes = [], []

    def step_seconds(self, runs):
        self.steps.append(list(runs))
        return 0.001 + 1e-5 * sum(new for new, _ in runs)

    def encode_seconds(self, patches):
        self.encodes.append(list(patches))
        return 0.1 + 1e-6 * sum(patches)

    def transfer_seconds(self, num_bytes):
        return 0.001 + 1e-9 * num_bytes


LIMITS = EngineLimits(token_budget=100, encoder_budget=100, max_num_seqs=8, num_kv_blocks=1000, block_size=10,
                      prefix_tokens=5, patches_per_token=4)


def costs(host=HostCosts(), limits=LIMITS) -> TwinCosts:
    return TwinCosts(RoundDevice(), host, limits)


def text(rid=0, arrival=0.0, prompt=20, output=3, **kwargs) -> SimRequest:
    return SimRequest(rid, arrival, (), prompt, output, **kwargs)


def picture(rid=0, arrival=0.0, tokens=40, prompt_text=20, output=3, **kwargs) -> SimRequest:
    return SimRequest(rid, arrival, (tokens,), prompt_text, output, **kwargs)


def run(topology, requests, twin=None):
    twin = twin or costs()
    outcomes, _ = se.simulate_twin(topology, twin, requests)
    return outcomes, twin.device


def test_a_text_request_alone_takes_one_prefill_step_then_a_step_a_token():
    (outcome,), device = run("integrated", [text(prompt=20, output=3)])
    ttft, tpot, finish = outcome
    assert ttft == pytest.approx(0.001 + 20e-5)  # the whole prompt in one step
    assert tpot == pytest.approx(0.001 + 1e-5)  # a decode step: one new token
    assert finish == pytest.approx(ttft + 2 * tpot)
    assert device.steps == [[(20, 20)], [(1, 21)], [(1, 22)]]  # attention's context grows with each token


def test_a_long_prompt_is_chunked_to_the_token_budget():
    (outcome,), device = run("integrated", [text(prompt=250, output=1)])
    assert [runs[0] for runs in device.steps] == [(100, 100), (100, 200), (50, 250)]
    assert outcome[0] == pytest.approx(3 * 0.001 + 250e-5)


def test_a_picture_is_encoded_once_in_the_step_whose_chunk_reaches_it():
    # 5 prefix tokens, the picture's 40 (160 patches), 20 more text tokens: one 65-token step with the encode
    (outcome,), device = run("integrated", [picture(tokens=40, prompt_text=25, output=1)])
    assert device.encodes == [[160]]
    assert outcome[0] == pytest.approx((0.1 + 160e-6) + 0.001 + 65e-5)


def test_a_picture_past_the_encoder_budget_left_waits_and_one_larger_than_the_budget_goes_alone():
    """Two requests arrive together: the first's 40-token picture takes 40 of the 100-token encoder budget, so
    the second's chunk stops before its 150-token picture (its 5 prefix tokens run); the next step encodes that
    picture alone, though it is larger than the whole budget."""
    busy = text(0, prompt=10, output=1)  # the engine is in a step when both pictures arrive: they wait for the next
    requests = [busy, picture(1, 1e-4, tokens=40, prompt_text=25, output=1),
                picture(2, 2e-4, tokens=150, prompt_text=5, output=1)]
    outcomes, device = run("integrated", requests)
    assert device.encodes == [[160], [600]]
    assert device.steps[1:3] == [[(65, 65), (5, 5)], [(100, 105)]]


def test_the_prefix_cache_skips_the_cached_blocks_and_the_encoder_cache_the_picture():
    requests = [picture(0, tokens=40, prompt_text=25, output=1, image_keys=("red",)),
                picture(1, arrival=1.0, tokens=40, prompt_text=25, output=1, cached_tokens=30, image_keys=("red",))]
    outcomes, device = run("integrated", requests)
    assert device.encodes == [[160]]  # the second request's picture is in the engine's encoder cache
    assert device.steps[1] == [(35, 65)]  # 30 positions cached: the rest computed
    assert outcomes[1][0] == pytest.approx(0.001 + 35e-5)


def test_an_encoder_service_s_answer_and_its_link_time_come_before_the_request_s_first_step():
    (outcome,), device = run("1e1pd", [picture(tokens=40, prompt_text=25, output=1)])
    link = 0.001 + 40 * 1000 * 1e-9  # the visual tokens' bytes
    assert outcome[0] == pytest.approx((0.1 + 160e-6) + link + 0.001 + 65e-5)


def test_no_step_waits_on_a_remote_encode():
    """Encode-ahead on the twin: a text request decodes while a picture's request waits off the step for the
    encoder service (it arrives as the text decodes), so each of the text's steps costs its own tokens alone, and
    the picture's TTFT is its encode, its link and its own step. (Waited for inside a step, one of the text's
    tokens would come 100 ms late.)"""
    arrivals = [text(0, prompt=20, output=5), picture(1, arrival=0.002, tokens=40, prompt_text=25, output=1)]
    (text_out, picture_out), device = run("1e1pd", arrivals)
    assert text_out[1] == pytest.approx(0.001 + 1e-5)  # TPOT: one decode's step, every time
    (text_integrated, _), _ = run("integrated", arrivals)  # the same arrivals, the tower inside the step
    assert text_integrated[1] > text_out[1] + 0.1 / 4  # one of its four gaps held the 100 ms encode
    assert all(len(step) == 1 for step in device.steps)  # no step ran both: the text finished before the tokens
    link = 0.001 + 40 * 1000 * 1e-9
    assert picture_out[0] == pytest.approx((0.1 + 160e-6) + link + 0.001 + 65e-5)


def test_prefill_then_decode_adds_the_kv_link_and_the_decode_instance_s_first_step():
    (outcome,), device = run("1e1p1d", [text(prompt=20, output=3)])
    prefill, link, decode_step = 0.001 + 20e-5, 0.001 + 20 * 100 * 1e-9, 0.001 + 1e-5
    ttft, tpot, finish = outcome
    assert ttft == pytest.approx(prefill + link + decode_step)  # the first token comes out with the second
    assert finish == pytest.approx(ttft + decode_step)
    assert device.steps == [[(20, 20)], [(1, 21)], [(1, 22)]]


def test_two_prefill_instances_share_one_encoder_service():
    requests = [picture(0, tokens=40, output=1), picture(1, tokens=40, output=1)]
    outcomes, device = run("1e2p1d", requests)
    encode = 0.1 + 160e-6
    assert len(device.encodes) == 2
    assert outcomes[1][0] - outcomes[0][0] == pytest.approx(encode, rel=1e-6)  # the second waits for the first


def test_a_full_kv_pool_preempts_the_newest_request_which_starts_again():
    tight = EngineLimits(token_budget=100, encoder_budget=100, max_num_seqs=8, num_kv_blocks=5, block_size=10,
                         prefix_tokens=5)
    requests = [text(0, prompt=20, output=15), text(1, prompt=20, output=15)]
    outcomes, device = run("integrated", requests, costs(limits=tight))
    assert all(o is not None for o in outcomes)
    recomputed = [runs for runs in device.steps if any(new > 1 for new, _ in runs)]
    assert len(recomputed) >= 3  # both prompts, then the preempted one again
    assert any(new > 20 for runs in recomputed for new, _ in runs)  # its prompt and the tokens it had generated
    alone, _ = run("integrated", requests)
    assert outcomes[1][2] > alone[1][2]


def test_a_decode_instance_without_room_fails_the_request_it_cannot_recompute():
    tight = EngineLimits(num_kv_blocks=2, block_size=10)
    (outcome,), _ = run("1e1p1d", [text(prompt=40, output=3)], costs(limits=tight))
    assert outcome is None


def test_the_host_adds_its_step_work_and_each_topology_s_request_delay():
    host = HostCosts(step_s=0.002, step_s_per_sequence=0.0005, request_s={"integrated": 0.01, "1eNp1d": 0.05},
                     request_s_per_byte={"integrated": 1e-6})
    (outcome,), _ = run("integrated", [text(prompt=20, output=2, body_bytes=1000)], costs(host))
    delay, step = 0.01 + 1000 * 1e-6, 0.002 + 0.0005
    assert outcome[0] == pytest.approx(delay + step + 0.001 + 20e-5)
    assert outcome[1] == pytest.approx(step + 0.001 + 1e-5)
    one_prefill, two_prefills = parse_topology("1e1p1d"), parse_topology("1e2p1d")
    assert host.request_delay(one_prefill, 1000) == host.request_delay(two_prefills, 1000) == 0.05  # one shape


def test_for_twin_reads_the_emulated_device_s_cost_model_and_engine_limits():
    from nanomm import LLM

    twin = TwinCosts.for_twin("h200:qwen2-vl-2b", HostCosts())
    with LLM(emulate="h200:qwen2-vl-2b") as llm:
        config, device_costs = llm.engine.config, llm.emulated.costs
    assert (twin.limits.token_budget, twin.limits.encoder_budget, twin.limits.max_num_seqs,
            twin.limits.num_kv_blocks, twin.limits.block_size) == (
        config.max_num_batched_tokens, config.max_num_encoder_tokens, config.max_num_seqs, config.num_kv_blocks,
        config.block_size)
    runs = [(512, 512), (1, 3000)]
    assert twin.device.step_seconds(runs) == device_costs.step_seconds(runs)
    assert twin.encode_s([256]) == device_costs.encode_seconds([1024])  # 2 x 2 patches a visual token


def test_the_encoder_service_batches_the_jobs_waiting_within_its_budget():
    """While the tower works on one job, three more arrive: the two that fit the 2,048-token budget together go
    into the next forward, the third waits for the one after; each job's answer crosses on its own."""
    twin = TwinCosts.for_twin("h200:qwen2-vl-2b", HostCosts())
    clock, answered = se.EventClock(), []
    service = se.EncoderService(clock, twin)
    for tokens in ([256], [1024], [512, 512], [1024]):
        service.submit(tokens, lambda t=tokens: answered.append((t, clock.now)))
    clock.run()
    batches = ([256], [1024, 512, 512], [1024])
    assert service.busy_s == pytest.approx(sum(twin.encode_s(b) for b in batches))
    assert sum(twin.encode_s(b) for b in batches) < sum(twin.encode_s(t) for t in ([256], [1024], [512, 512], [1024]))
    first, second = twin.encode_s(batches[0]), twin.encode_s(batches[1])
    assert [t for t, _ in answered] == [[256], [1024], [512, 512], [1024]]
    assert answered[1][1] == pytest.approx(first + second + twin.visual_link_s([1024]))
    assert answered[2][1] == pytest.approx(first + second + twin.visual_link_s([512, 512]))

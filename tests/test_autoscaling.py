"""The autoscaling policies and the load window (nanomm/serve/autoscaling.py), by hand: no Ray needed."""

from types import SimpleNamespace

import pytest

from nanomm.emulate import EmulatedDevice
from nanomm.serve.autoscaling import LoadPolicy, LoadWindow, RequestsPolicy, SLOPolicy, replica_capacity


def pool(current: int, **metrics: list[float]) -> SimpleNamespace:
    """What a policy reads of Ray's AutoscalingContext: the replica count and each metric by replica."""
    return SimpleNamespace(current_num_replicas=current,
                           aggregated_metrics={name: {f"r{i}": v for i, v in enumerate(values)}
                                               for name, values in metrics.items()})


def test_the_window_counts_what_arrived_in_its_last_seconds():
    window = LoadWindow(window_s=10.0)
    window.arrive(0.0, 1000)  # drops out of the window by t=11
    window.arrive(5.0, 256)
    window.arrive(9.0, 0)
    for seconds in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9,
                    3.0):
        window.first_answer(9.5, seconds)
    window.leave()
    assert window.report(11.0) == {"visual_tokens_per_s": 25.6, "in_flight": 2.0, "first_answer_p95_s": 1.9}
    assert window.report(30.0) == {"visual_tokens_per_s": 0.0, "in_flight": 2.0, "first_answer_p95_s": 0.0}


def test_the_load_policy_divides_the_pool_s_load_by_a_replica_s_share_of_capacity():
    # 3 prefill replicas receive 900 + 700 + 500 = 2100 visual tokens/s; one serves 1000 at 70%: 3 replicas
    prefill = LoadPolicy(role="prefill", capacity=1000, utilization=0.7)
    assert prefill(pool(3, visual_tokens_per_s=[900, 700, 500], in_flight=[9, 9, 9])) == (3, {})
    assert prefill(pool(3, visual_tokens_per_s=[900, 700, 501], in_flight=[0, 0, 0])) == (4, {})
    # decode replicas count running sequences: 40 + 30 against 64 x 0.5 = 32 each: 3 replicas
    decode = LoadPolicy(role="decode", capacity=64, utilization=0.5)
    assert decode(pool(2, in_flight=[40, 30], visual_tokens_per_s=[1e6, 1e6])) == (3, {})
    assert decode(pool(2, in_flight=[0, 0])) == (0, {})  # Ray's bounds keep min_replicas
    with pytest.raises(ValueError, match="no load signal for the role 'router'"):
        LoadPolicy(role="router", capacity=1)


def test_the_requests_policy_counts_requests_whatever_they_carry():
    policy = RequestsPolicy(target=2)
    assert policy(pool(1, in_flight=[5], visual_tokens_per_s=[0])) == (3, {})
    assert policy(pool(1, in_flight=[5], visual_tokens_per_s=[1e6])) == (3, {})


def test_the_slo_policy_grows_in_proportion_and_shrinks_by_one():
    policy = SLOPolicy(target_s=1.0, low=0.5)
    assert policy(pool(2, first_answer_p95_s=[2.0, 1.0])) == (3, {})  # mean p95 1.5 s: 2 x 1.5
    assert policy(pool(2, first_answer_p95_s=[0.9, 0.6])) == (2, {})  # within [0.5, 1] s: stay
    assert policy(pool(3, first_answer_p95_s=[0.1, 0.2, 0.3])) == (2, {})  # under 0.5 s: one fewer


def test_capacity_from_the_cost_model_is_what_one_replica_keeps_up_with():
    costs = EmulatedDevice.from_value("h200:qwen2-vl-2b").costs
    # an encoder: 1024-token pictures back to back; a prefill replica: each one's prefill (its tokens came ahead)
    assert replica_capacity(costs, "encoder", 64) * costs.encode_seconds([4096]) == pytest.approx(1024)
    per_picture = costs.step_seconds([(1024, 1024)])
    assert replica_capacity(costs, "prefill", 64) * per_picture == pytest.approx(1024)
    # a decode replica: the most sequences whose step fits the TPOT target, and no more
    slow = EmulatedDevice.from_value("l4:qwen2.5-vl-3b").costs
    sequences = int(replica_capacity(slow, "decode", 256, tpot_slo_s=0.05))
    assert slow.step_seconds([(1, 2048)] * sequences) <= 0.05 < slow.step_seconds([(1, 2048)] * (sequences + 1))
    assert replica_capacity(costs, "decode", 64, tpot_slo_s=1.0) == 64  # max_num_seqs bounds it

"""Cache-affine routing (serve/affinity.py): the pure policy, the router over real engines, and the twin's dp<N>
over multi-turn sessions. Expected values are counted here (engines picked, hits), never taken from the policy."""

import io
import re

import httpx
import pytest

from helpers import data_url, random_image
from nanomm.serve.affinity import BLOCK_CHARACTERS, AffinityMap, CacheAffinity, PromptKeys, prompt_keys


def chat(turns: list[tuple[bytes | None, str]], answers: list[str]) -> dict:
    """A chat body: each turn a user message (a picture, its question), each answer the assistant's reply."""
    messages = []
    for i, (picture, question) in enumerate(turns):
        parts = ([{"type": "image_url", "image_url": {"url": data_url(picture)}}] if picture else [])
        messages.append({"role": "user", "content": parts + [{"type": "text", "text": question}]})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return {"model": "m", "messages": messages}


def png(seed: int, size: int = 56) -> bytes:
    buffer = io.BytesIO()
    random_image(size, size, seed).save(buffer, "PNG")
    return buffer.getvalue()


QUESTION = "describe the picture in a few careful words, " * 3  # longer than a block of text


def session_body(session: int, turn: int) -> dict:
    """Turn `turn` (from 1) of a session: every earlier turn's picture, question and answer, then its own."""
    turns = [(png(100 * session + t), f"{QUESTION} ({session}, {t})") for t in range(1, turn + 1)]
    return chat(turns, [f"answer {t} of session {session}, " * 4 for t in range(1, turn)])


def route(policy: CacheAffinity, body: dict, outstanding: dict) -> str:
    """One request through the policy, over a load pick that takes the first of the least loaded engines."""
    fallback = min(outstanding, key=outstanding.get)
    return policy.pick(prompt_keys(body), outstanding, fallback)


# -- the keys ------------------------------------------------------------------------------------------------------

def test_a_turn_s_keys_start_with_the_previous_turn_s_and_name_each_picture_once():
    first, second = prompt_keys(session_body(0, 1)), prompt_keys(session_body(0, 2))
    assert len(first.prefix) >= 3 and len(first.pictures) == 1 and len(second.pictures) == 2
    shared = len(first.prefix) - 1  # the last piece of a turn is a partial block, continued by the next turn
    assert second.prefix[:shared] == first.prefix[:shared] and second.prefix[shared] != first.prefix[shared]
    assert second.pictures[0] == first.pictures[0] and second.pictures[1] != first.pictures[0]
    other = prompt_keys(session_body(1, 1))
    assert other.pictures[0] != first.pictures[0] and other.prefix[1] != first.prefix[1]


def test_text_is_cut_into_blocks_and_a_picture_is_hashed_not_decoded():
    keys = prompt_keys({"prompt": "x" * (3 * BLOCK_CHARACTERS + 5)})
    assert [tokens for _, tokens in keys.prefix] == [BLOCK_CHARACTERS / 4] * 3 + [5 / 4]
    broken = {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "data:image/png;base64,!!not"}}]}]}
    seen = []
    keys = prompt_keys(broken, picture_tokens=lambda payload: seen.append(payload) or 7.0)
    assert seen == ["!!not"] and [tokens for _, tokens in keys.pictures] == [7.0]


# -- the policy ----------------------------------------------------------------------------------------------------

def test_each_session_sticks_to_the_engine_its_first_turn_went_to():
    """Four sessions, four engines, every engine equally loaded: the first turns go by load (a, b, c, d, as each
    engine is charged one unit until the next request), and every later turn to its session's engine."""
    policy, engines = CacheAffinity(slack=0), "abcd"
    outstanding = dict.fromkeys(engines, 0.0)
    first = {}
    for session in range(4):
        first[session] = route(policy, session_body(session, 1), outstanding)
        outstanding[first[session]] += 1  # still running: the next first turn goes to another engine
    assert [first[s] for s in range(4)] == list(engines)
    outstanding = dict.fromkeys(engines, 0.0)
    for turn in (2, 3):
        for session in reversed(range(4)):  # another order than the first turns'
            assert route(policy, session_body(session, turn), outstanding) == first[session]
    # every chat opens alike (the user's role, before the picture): later first turns find a holding that opening,
    # a busier engine than the slack allows
    assert policy.outcomes == {"affine": 8, "spilled": 3, "new": 1}


def test_a_busy_engine_beyond_the_slack_loses_the_session_to_the_least_loaded():
    policy = CacheAffinity(slack=100)
    assert route(policy, session_body(0, 1), {"a": 0.0, "b": 0.0}) == "a"
    assert route(policy, session_body(0, 2), {"a": 100.0, "b": 0.0}) == "a"  # within the slack
    assert route(policy, session_body(0, 3), {"a": 101.0, "b": 0.0}) == "b"  # past it
    assert route(policy, session_body(0, 4), {"a": 0.0, "b": 50.0}) == "b"  # the session now lives on b
    assert policy.outcomes == {"affine": 2, "spilled": 1, "new": 1}


def test_the_engine_holding_the_longest_prefix_wins():
    policy = CacheAffinity(slack=10)
    route(policy, session_body(0, 1), {"a": 0.0, "b": 1.0})  # turn 1 -> a
    policy.map.record(prompt_keys(session_body(0, 2)), "b")  # turn 2 went to b: b holds more of turn 3
    assert route(policy, session_body(0, 3), {"a": 0.0, "b": 5.0}) == "b"


def test_the_map_forgets_the_least_recently_used_keys_past_its_capacity():
    first, second = prompt_keys({"prompt": "a" * 200}), prompt_keys({"prompt": "b" * 200})
    assert len(first.prefix) == len(second.prefix) == 4
    memory = AffinityMap(capacity=6)
    memory.record(first, "e1")
    memory.record(second, "e2")
    assert len(memory) == 6
    assert memory.savings(second) == {"e2": 50.0}
    assert [key in memory.entries for key, _ in first.prefix] == [False, False, True, True]  # the oldest went
    assert memory.savings(first) == {"e1": 50.0}  # a chained key names its whole prefix: the deepest is enough
    memory.record(prompt_keys({"prompt": "c" * 200}), "e3")
    assert memory.savings(first) == {} and len(memory) == 6
    memory.forget("e2")
    assert len(memory) == 4 and memory.savings(second) == {}  # c's four keys are left


@pytest.mark.parametrize("bad", [dict(slack=-1), dict(slack=0, capacity=0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        CacheAffinity(**bad)


def test_only_engines_in_the_pool_are_picked():
    policy = CacheAffinity(slack=1000)
    policy.map.record(prompt_keys(session_body(0, 1)), "gone")
    assert route(policy, session_body(0, 2), {"a": 5.0, "b": 0.0}) == "b"


# -- the router over real engines --------------------------------------------------------------------------------

def prefix_hit_rate(url: str) -> float:
    found = re.search(r"^nanomm_prefix_cache_hit_rate (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(found.group(1))


@pytest.mark.parametrize("routing", ["affinity", "load"])
def test_the_router_sends_a_session_s_second_turn_where_its_first_went(ckpt, routing):
    """dp2, one request at a time: affinity sends turn 2 to turn 1's engine, whose prefix cache then hits; load
    sends it to the other engine (the one sent fewer), whose cache has nothing of it."""
    from nanomm.serve.app import Server, ServerConfig
    from nanomm.serve.router import Router
    from nanomm.serve.testing import BackgroundServer
    from test_disagg import make_llm

    sampling = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    first = {**session_body(0, 1), **sampling}
    engines = [Server(make_llm(ckpt), ServerConfig("m")) for _ in range(2)]
    with BackgroundServer(engines[0]) as a, BackgroundServer(engines[1]) as b, \
            BackgroundServer(Router([], [], [], engine_urls=[a, b], routing=routing)) as router:
        reply = httpx.post(router + "/v1/chat/completions", json=first, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()["choices"][0]["message"]["content"]
        second = {**first, "messages": first["messages"] + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(2))}},
                                         {"type": "text", "text": "and this one?"}]}]}
        assert httpx.post(router + "/v1/chat/completions", json=second, timeout=120).status_code == 200
        metrics = httpx.get(router + "/metrics").text
        rates = [prefix_hit_rate(a), prefix_hit_rate(b)]
    routed = [float(re.search(rf'nanomm_router_routed_total{{role="engine",url="{u}"}} (\S+)', metrics).group(1))
              for u in (a, b)]
    if routing == "affinity":
        assert routed == [2.0, 0.0] and rates[0] > 0 and rates[1] == 0
        assert 'nanomm_router_affinity_picks_total{outcome="affine",role="engine"} 1.0' in metrics
    else:
        assert routed == [1.0, 1.0] and rates == [0.0, 0.0]


def test_the_router_refuses_an_unknown_routing():
    from nanomm.serve.router import Router

    with pytest.raises(ValueError, match="routing"):
        Router([], [], [], engine_urls=["http://e"], routing="sticky")


# -- the twin ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def twin_costs():
    from nanomm.sim.twin import HostCosts, TwinCosts

    return TwinCosts.for_twin("h200:qwen2-vl-2b", HostCosts())


def test_on_the_twin_a_session_s_turns_share_their_blocks_and_pictures(twin_costs):
    from nanomm.sim.chats import make_chats

    turns = [r for r in make_chats("1x448x448:1", 1.0, 2, 3, 2.0, seed=3) if r.id < 3]  # session 0
    assert [len(r.image_tokens) for r in turns] == [1, 2, 3] and turns[0].image_tokens == (256,)
    assert turns[1].prompt_tokens == 16 + 256 + 64 + 32 + 256 + 64  # template, turn 1 with its answer, turn 2
    assert turns[1].image_offsets == (16, 16 + 256 + 64 + 32)
    assert turns[1].block_keys[:len(turns[0].block_keys)] == turns[0].block_keys
    assert len(turns[0].block_keys) == (16 + 256 + 64 + 32 - 1) // 16


def test_on_the_twin_dp4_affinity_hits_the_prefix_cache_more_with_goodput_no_lower(twin_costs):
    """Multi-turn sessions on dp4, seeded: affinity routing finds more of each prompt in its engine's prefix
    cache than the router's load routing, and keeps at least as many requests within the SLO."""
    from nanomm.sim.chats import make_chats
    from nanomm.sim.stages import simulate

    requests = make_chats("1x448x448:1", 10.0, 40, 4, 2.0, seed=0, text_tokens=200, output_tokens=50)
    runs = {routing: simulate("dp4", twin_costs, requests, 0.5, 0.05, routing=routing)
            for routing in ("load", "affinity")}
    load, affinity = (runs[r].summary() for r in ("load", "affinity"))
    assert load["requests"] == affinity["requests"] == 160
    assert affinity["caches"]["prefix_hit_rate"] > load["caches"]["prefix_hit_rate"] + 0.05
    assert affinity["goodput_rps"] >= load["goodput_rps"]
    # the best affinity can do: every turn after the first finds the whole of its session's history
    history = sum(r.prompt_tokens - r.image_tokens[-1] - 200 for r in requests) / sum(r.prompt_tokens for r in requests)
    assert affinity["caches"]["prefix_hit_rate"] <= history + 0.01


# -- Ray's request router ------------------------------------------------------------------------------------------

def test_ray_s_request_router_puts_the_session_s_replica_first_within_the_slack():
    """Ray calls choose_replicas, then on_request_routed and on_request_completed around each call; the state alone,
    as tests/test_ray.py drives LeastWorkRouter's."""
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("ray")
    from nanomm.serve.ray import CacheAffinityRouter

    router = object.__new__(CacheAffinityRouter)
    router.initialize_state(slack=1000)
    a, b, c = (SimpleNamespace(replica_id=name) for name in "abc")

    def call(request_id: str, body: dict, tokens: float):
        return SimpleNamespace(kwargs={"work": 1, "affinity": (prompt_keys(body), tokens)},
                               metadata=SimpleNamespace(internal_request_id=request_id))

    def ranking(request) -> list[str]:
        return [rank[0].replica_id for rank in asyncio.run(router.choose_replicas([a, b, c], request))]

    first = call("turn 1", session_body(0, 1), 900)
    assert ranking(first) == ["a", "b", "c"]  # nothing known: the load order
    router.on_request_routed(first, "b", None)  # Ray sent it to b after all: b is remembered
    second = call("turn 2", session_body(0, 2), 1500)
    assert ranking(second) == ["b", "a", "c"]  # b holds 900 tokens, within the slack of a's and c's 0
    router.on_request_routed(second, "b", None)
    assert ranking(call("turn 3", session_body(0, 3), 2000)) == ["a", "c", "b"]  # b: 2400 tokens, past the slack
    router.on_request_completed("b", "turn 1")
    router.on_request_completed("b", "turn 2")
    assert ranking(call("turn 3", session_body(0, 3), 2000)) == ["b", "a", "c"]
    router._replicas, router._replica_id_set, router._queue_len_gauge_last_update = {}, set(), {}  # Ray's own state
    router.on_replica_actor_died("b")
    assert ranking(call("turn 3", session_body(0, 3), 2000)) == ["a", "b", "c"]  # b's keys forgotten

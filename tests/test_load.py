"""nanomm/bench/load.py, the load generator (`nanomm-bench load`): its arithmetic against hand-worked numbers and numpy, its Poisson
schedule, its mixes, and one small open-loop run against a server started here (every request answered, the
visual tokens each picture size must give, the client's TTFT no shorter than the server's own); the multi-turn
chat sessions (--sessions: the conversation each turn sends, and a run whose prefix-cache hits and KV figures are
checked by hand); and the soak's memory summary (nanomm/bench/soak.py) on a hand-made curve."""

import argparse
import asyncio
import json
import random

import numpy
import pytest

from nanomm import LLM
from nanomm.bench import cli, load, soak
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.testing import BackgroundServer
from nanomm.sim.stats import percentile


def test_the_one_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)  # rank 2.85: 3 + 0.85
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    rng = random.Random(0)
    for n in (2, 5, 17, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 37, 50, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(numpy.percentile(values, q), rel=1e-12)


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
    curve = [(0.0, 100.0), (1.0, 150.0), (2.5, 160.0), (3.0, 170.0), (4.0, 176.0)]
    summary = soak.memory_summary(curve, seconds=4.0)
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
        args = cli.parse(load, ["--url", base, "--trace", "tiny", "--seed", "2", "--slo-ttft", "60"])
        results = load.run_trace(base, args, lambda line: None)
    assert [r["phase"] for r in results] == ["text", "pictures"]
    expected = load.trace_schedule(tiny, seed=2)
    for result, phase, visual, answer in zip(results, tiny, (0, 64), (3, 6)):
        records = result["records"]
        assert len(records) == sum(a.phase == phase.name for a in expected) == result["completed"] > 0
        assert {r["visual_tokens"] for r in records} == {visual} and {r["completion_tokens"] for r in records} == {answer}


# -- multi-turn chat sessions (--sessions) ---------------------------------------------------------------------

def test_a_conversation_body_carries_every_earlier_turn_and_its_answer():
    first, second, third = (load.UserTurn(("data:image/png;base64,AAA",), "one?"), load.UserTurn((), "two?"),
                            load.UserTurn(("data:a", "data:b"), "three?"))

    def user(urls, text):
        return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                            {"type": "text", "text": text}]}

    head = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 7,
            "temperature": 0.0}
    assert load.conversation_body("m", [first], [], 7) == {**head, "messages": [user(["data:image/png;base64,AAA"],
                                                                                      "one?")]}
    kwargs = {"old_image_policy": "drop", "keep_last_images": 1}
    assert load.conversation_body("m", [first, second, third], ["A1", "A2"], 7, kwargs) == {
        **head, "mm_processor_kwargs": kwargs,
        "messages": [user(["data:image/png;base64,AAA"], "one?"), {"role": "assistant", "content": "A1"},
                     user([], "two?"), {"role": "assistant", "content": "A2"}, user(["data:a", "data:b"], "three?")]}
    with pytest.raises(AssertionError):
        load.conversation_body("m", [first, second], [], 7)  # the first turn's answer is missing


def test_session_options_pictures_and_think_times_are_seeded():
    args = cli.parse(load, ["--sessions", "3", "--turns", "5", "--images-per-turn", "2", "--image-size", "56x84",
                            "--think-time", "2", "--seed", "4", "--old-image-policy", "downscale:50176",
                            "--keep-last-images", "2"])
    plan = load.session_plan(args)
    assert (plan.sessions, plan.turns, plan.images_per_turn, plan.image_size) == (3, 5, 2, (56, 84))
    assert plan.mm_processor_kwargs == {"old_image_policy": "downscale:50176", "keep_last_images": 2}
    assert load.session_plan(cli.parse(load, ["--sessions", "1"])).mm_processor_kwargs is None
    turn = load.user_turn(plan, 1, 2)
    assert turn == load.user_turn(plan, 1, 2) and len(turn.images) == 2 and len(set(turn.images)) == 2
    assert turn.images[0] not in load.user_turn(plan, 0, 2).images + load.user_turn(plan, 1, 3).images
    pauses = load.think_times(plan, 0)
    assert len(pauses) == 5 and pauses[0] == 0.0 and min(pauses[1:]) > 0 and pauses == load.think_times(plan, 0)
    assert pauses != load.think_times(plan, 1)
    long = load.think_times(load.SessionPlan(1, 20_001, 0, think_time_s=2.0), 0)[1:]
    assert sum(long) / len(long) == pytest.approx(2.0, rel=0.05)  # exponential, of mean --think-time
    assert load.think_times(load.SessionPlan(1, 3, 0), 0) == [0.0, 0.0, 0.0]
    for bad in (["--sessions", "1", "--old-image-policy", "shrink"], ["--sessions", "1", "--keep-last-images", "0"],
                ["--keep-last-images", "2"], ["--sessions", "1", "--image-size", "448"]):
        with pytest.raises(SystemExit):
            cli.parse(load, bad)


async def encoder_cache_probe(base: str, picture: dict, record) -> None:
    """One streamed request whose text comes before `picture` (an image_url part), read by load.send_one."""
    body = {"model": "load", "stream": True, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Something else first."}, picture]}]}
    async with load.client_session(base, 60) as http:
        await load.send_one(http, json.dumps(body).encode(), record, lambda: 0.0)


def test_chat_sessions_against_a_server_send_the_conversation_and_hit_the_prefix_cache(monkeypatch, tmp_path):
    """2 sessions x 3 turns x 1 picture through main(): every request carries the earlier turns with the
    answers the server gave, the prefix cache holds the earlier turns, and the JSON's KV figures add up. Then a
    picture of the run again, after other text: usage's encoder_cache_hits, as the client reads it."""
    from nanomm import demo_checkpoint

    sent = []  # (session, turn, body) of every request, as sent

    async def spy(http, body, record, clock, texts=None):
        sent.append((getattr(record, "session", None), getattr(record, "turn", None), json.loads(body)))
        await send_one(http, body, record, clock, texts)

    send_one = load.send_one
    monkeypatch.setattr(load, "send_one", spy)
    llm = LLM(str(demo_checkpoint()), device="cpu", dtype="float32")
    per_token, _ = load.kv_bytes_per_token_of([str(demo_checkpoint())], ["--dtype", "float32"])
    stats = llm.engine.stats()
    assert per_token == stats["kv_bytes_per_token"]  # the script's figure is the engine's
    out = tmp_path / "chat.json"
    with BackgroundServer(Server(llm, ServerConfig("load"))) as base:
        assert cli.run(load, ["--url", base, "--sessions", "2", "--turns", "3", "--images-per-turn", "1",
                          "--think-time", "0", "--max-tokens", "6", "--kv-bytes-per-token", str(per_token),
                          "--json", str(out)]) == 0
        # The first picture again, after other text: no prefix-cache hit, but the encoder cache holds its tokens.
        picture = next(b for s, t, b in sent if (s, t) == (0, 1))["messages"][0]["content"][0]
        again = load.RequestRecord(0.0, 1)
        asyncio.run(encoder_cache_probe(base, picture, again))
    assert again.error is None and (again.encoder_cache_hits, again.cached_tokens) == (1, 0)
    result = json.loads(out.read_text())
    records = {(r["session"], r["turn"]): r for r in result["records"]}
    assert sorted(records) == [(s, t) for s in range(2) for t in (1, 2, 3)] and result["errors"] == 0
    chats = [(s, t, b) for s, t, b in sent if s is not None]  # the warm-up's record is no TurnRecord
    assert sorted((s, t) for s, t, _ in chats) == sorted(records)
    bodies = {(s, t): b for s, t, b in chats}
    for (session, turn), body in bodies.items():
        messages, r = body["messages"], records[session, turn]
        assert [m["role"] for m in messages] == ["user", "assistant"] * (turn - 1) + ["user"]
        assert sum(p["type"] == "image_url" for m in messages[::2] for p in m["content"]) == turn == r["num_images"]
        assert 1 <= r["completion_tokens"] <= 6 and r["visual_tokens"] == 144 * turn  # 448x448 -> 168x168 -> 12 x 12
        if turn > 1:
            before = records[session, turn - 1]
            assert messages[:-2] == bodies[session, turn - 1]["messages"]  # the earlier turns, as sent
            assert messages[-2] == {"role": "assistant", "content": before["answer"]} and before["answer"]
            assert r["prompt_tokens"] > before["prompt_tokens"] + 144  # the answer, a picture and a question more
            assert before["prompt_tokens"] - 16 < r["cached_tokens"] < r["prompt_tokens"]  # the earlier prompt: cached
    assert [t["turn"] for t in result["turns"]] == [1, 2, 3]
    for row in result["turns"]:
        mine = [records[s, row["turn"]] for s in range(2)]
        assert row["completed"] == row["requests"] == 2
        assert row["prompt_tokens_mean"] == sum(r["prompt_tokens"] for r in mine) / 2
        assert row["cached_tokens_mean"] == sum(r["cached_tokens"] for r in mine) / 2
        assert row["cached_share"] == pytest.approx(sum(r["cached_tokens"] for r in mine) /
                                                     sum(r["prompt_tokens"] for r in mine))
        assert row["ttft_s_mean"] == pytest.approx(sum(r["first_token_at"] - r["sent_at"] for r in mine) / 2)
        assert row["encoder_cache_hits_mean"] == sum(r["encoder_cache_hits"] for r in mine) / 2
    budget = stats["kv_capacity_tokens"]  # the KV pool in tokens, as the engine counts it
    peaks = [max(records[s, t]["prompt_tokens"] + records[s, t]["completion_tokens"] for t in (1, 2, 3))
             for s in range(2)]
    assert [(s["peak_tokens"], s["kv_bytes"], s["sessions_in_budget"]) for s in result["sessions"]] == [
        (peak, peak * per_token, budget // peak) for peak in peaks]
    kv = result["kv"]
    assert (kv["budget_tokens"], kv["kv_bytes_per_token"], kv["peak_tokens_per_session"]) == (budget, per_token,
                                                                                             max(peaks))
    assert kv["sessions_in_budget"] == budget // max(peaks) and kv["budget_bytes"] == budget * per_token


def flag_values(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == flag]


def test_every_topology_of_the_grammar_starts_its_pools_and_names_each_instance():
    """No process started: the commands themselves. Engines behind the router for dp<N> and <X>e<Y>pd (each with
    one encoder, round robin), a split engine's pools all named to the router, and 1e1pd without a router."""
    commands, front = load.topology_commands("dp2", ["ck"], "m", [])
    assert (sorted(commands), front) == (["integrated 1", "integrated 2", "router"], "router")
    assert flag_values(commands["router"], "--engine-url") == [load.url_of(commands[f"integrated {i}"]) for i in (1, 2)]
    commands, front = load.topology_commands("2e3pd", ["ck"], "m", [])
    assert (sorted(commands), front) == (["encoder 1", "encoder 2", "lm 1", "lm 2", "lm 3", "router"], "router")
    encoders = [load.url_of(commands[f"encoder {i}"]) for i in (1, 2)]
    assert [flag_values(commands[f"lm {i}"], "--encoder-url") for i in (1, 2, 3)] == [[encoders[0]], [encoders[1]],
                                                                                        [encoders[0]]]
    assert len(flag_values(commands["router"], "--engine-url")) == 3 and "--encoder-url" not in commands["router"]
    commands, front = load.topology_commands("2e2p2d", ["ck"], "m", [])
    assert (len(commands), front) == (7, "router")
    assert {role: len(flag_values(commands["router"], f"--{role}-url")) for role in ("encoder", "prefill", "decode")} \
        == {"encoder": 2, "prefill": 2, "decode": 2}
    assert flag_values(commands["prefill 2"], "--encoder-url") == [load.url_of(commands[f"encoder {i}"]) for i in (1, 2)]
    assert sorted(load.topology_commands("1e1pd", ["ck"], "m", [])[0]) == ["encoder", "lm"]
    assert sorted(load.topology_commands("integrated", ["ck"], "m", [])[0]) == ["integrated"]
    assert not any("--host" in cmd for cmd in commands.values())  # nanomm-serve's default: 127.0.0.1


@pytest.mark.parametrize("name, words", [("3e2pd", "of 3 encoders at most 2 would work"), ("2e", "unknown topology"),
                                         ("dp0", "every count at least 1")])
def test_a_topology_the_load_generator_cannot_start_is_a_clear_error(name, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        load.startable_topology(name)

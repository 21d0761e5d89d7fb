"""The emulated device (nanomm/emulate): the real engine serving a named model on a named GPU with no weights, the
device's work replaced by the cost model's time (slept) and tokens from a stand-in. Every check here is of a value
or a counter, never of a clock: time.sleep is replaced by a recorder wherever a test reads what was slept."""

import json
import subprocess
import sys

import httpx
import pytest
from PIL import Image

from nanomm import LLM, SamplingParams
from nanomm.emulate.runner import EmulatedRunner
from nanomm.emulate.costs import GPUS, CostModel, Efficiency, Gpu, ModelShape
from nanomm.emulate import load_configs, model_folder, model_shape
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.testing import BackgroundServer

TWIN = "h200:qwen2-vl-2b"


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """What the twin waits, in order, instead of waiting it (only the twin's runner: other threads sleep as usual)."""
    seconds = []
    monkeypatch.setattr(EmulatedRunner, "wait", lambda runner, s: seconds.append(s))
    return seconds


def chats(count: int, size: int = 448, words: str = "What is in the picture?") -> list:
    colours = ["red", "green", "blue", "white", "black", "yellow"]
    return [[{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (size, size), colours[i % 6])},
                                          {"type": "text", "text": f"{words} {i}"}]}] for i in range(count)]


def record_steps(llm) -> list[list[tuple[int, int]]]:
    """(new tokens, context after them) of every chunk of every step the runner is handed."""
    steps, run = [], llm.engine.runner.run

    def recording(chunks):
        steps.append([(c.num_tokens, c.end) for c in chunks])
        return run(chunks)

    llm.engine.runner.run = recording
    return steps


def test_each_step_and_encode_takes_the_cost_model_s_time(slept):
    """The twin assigns every step the cost model's time for exactly the chunks the scheduler handed it, every
    encode the tower's time for the pictures it had to encode, and sleeps each, in order."""
    with LLM(emulate=TWIN, max_num_batched_tokens=512) as llm:
        steps = record_steps(llm)
        llm.chat(chats(5), SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        runner, costs = llm.engine.runner, llm.emulated.costs
        assert len(steps) == len(runner.step_seconds) > 5  # 512-token chunks: the prompts take several steps
        assert list(runner.step_seconds) == [costs.step_seconds(runs) for runs in steps]
        assert any(new > 1 for runs in steps for new, _ in runs) and any(new == 1 for new, _ in steps[-1])
        patches = 448 * 448 // 14 ** 2  # a 448x448 picture is 32x32 patches of 14 pixels
        assert sorted(p for batch in runner.encoded_patches for p in batch) == [patches] * 5  # five colours
        assert list(runner.encode_seconds) == [costs.encode_seconds(batch) for batch in runner.encoded_patches]
        assert sorted(slept) == sorted([*runner.step_seconds, *runner.encode_seconds])
        assert llm.stats()["visual_tokens_encoded"] == 5 * patches // 4


def test_the_cost_model_by_hand():
    """The formulas on round numbers: a step is its floor plus the larger of its compute and its memory time."""
    gpu = Gpu("test", bf16_flops=1e12, hbm_bytes_per_s=1e11, memory_gib=10)
    shape = ModelShape(lm_params=10**9, lm_weight_bytes=2 * 10**9, layers=10, attention_width=1000,
                       kv_bytes_per_token=1000, vision_params=10**8, vision_weight_bytes=2 * 10**8, vision_depth=4,
                       vision_width=100, vision_window_patches=0, vision_full_blocks=4, visual_token_bytes=10)
    costs = CostModel(gpu, shape, Efficiency(compute=0.5, bandwidth=0.5, step_floor_s=1e-3,
                                             step_floor_per_layer_s=1e-4, encode_floor_s=2e-3,
                                             link_bytes_per_s=1e9, link_latency_s=1e-4))
    floor = 1e-3 + 10 * 1e-4
    # one decode at context 100: reads 2e9 weight bytes + 1e5 KV bytes at 5e10 B/s; 2e9 + 4e6 FLOPs at 5e11
    assert costs.step_seconds([(1, 100)]) == pytest.approx(floor + (2e9 + 1e5) / 5e10)
    # 1000 new tokens after 1000 cached: 2e12 + 4 * 10 * 1000 * 1000 * (2000 - 499.5) FLOPs: compute bound
    assert costs.step_seconds([(1000, 2000)]) == pytest.approx(floor + (2e12 + 4e4 * 1000 * 1500.5) / 5e11)
    assert costs.step_seconds([]) == 0.0
    # a picture of 100 patches: 2 * 1e8 * 100 + 4 * 100 (width) * 100 * 100 * 4 (blocks) FLOPs against 2e8
    # weight bytes: compute bound
    assert costs.encode_seconds([100]) == pytest.approx(2e-3 + (2e10 + 1.6e7) / 5e11)
    assert costs.transfer_seconds(10**6) == pytest.approx(1e-3 + 1e-4)
    assert costs.step_kernel_seconds([(1, 100)]) == pytest.approx(costs.step_seconds([(1, 100)]) - 1e-3)


def test_the_lm_head_is_charged_only_for_the_rows_that_sample():
    """A 1000-token prompt chunk samples one row: of 1e9 parameters, the head's 1e8 multiply one row only."""
    gpu = Gpu("test", bf16_flops=1e12, hbm_bytes_per_s=1e11, memory_gib=10)
    shape = ModelShape(lm_params=10**9, lm_weight_bytes=2 * 10**9, layers=10, attention_width=1000,
                       kv_bytes_per_token=1000, vision_params=0, vision_weight_bytes=0, vision_depth=0,
                       vision_width=0, vision_window_patches=0, vision_full_blocks=0, visual_token_bytes=0,
                       lm_head_params=10**8)
    costs = CostModel(gpu, shape, Efficiency(compute=0.5, bandwidth=0.5, step_floor_per_layer_s=0))
    attention = 4 * 10 * 1000 * 1000 * (1000 - 499.5)
    assert costs.step_kernel_seconds([(1000, 1000)]) == pytest.approx((2 * 9e8 * 1000 + 2e8 + attention) / 5e11)
    two_decodes = 2 * 10**9 * 2 + 4 * 10 * 1000 * 2 * 100  # every row samples: the whole model on both
    assert costs.step_kernel_seconds([(1, 100)] * 2) == pytest.approx(max(two_decodes / 5e11, (2e9 + 2e5) / 5e10))


HUB_PARAMETERS = {  # each model's size as its hub page states it (safetensors, billions, three figures)
    "qwen2-vl-2b": 2.21, "qwen2.5-vl-3b": 3.75, "qwen3-vl-2b": 2.13, "qwen3-vl-4b": 4.44}


@pytest.mark.parametrize("name", sorted(HUB_PARAMETERS))
def test_each_shipped_config_makes_a_model_of_its_published_size(name):
    """The shipped config.json files are the real ones: the language model (its head tied to the embedding) and
    the tower add up to the hub's parameter count."""
    shape = model_shape(load_configs(name)[0])
    assert round((shape.lm_params + shape.vision_params) / 1e9, 2) == HUB_PARAMETERS[name]


def test_a_cost_file_replaces_the_defaults_it_names(tmp_path):
    costs = CostModel(GPUS["h200"], ModelShape(*[1] * 12))
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"efficiency": {"step_floor_s": 0.004}, "gpu": {"hbm_bytes_per_s": 4e12}}))
    measured = costs.with_cost_file(str(path))
    assert measured.efficiency.step_floor_s == 0.004 and measured.gpu.hbm_bytes_per_s == 4e12
    assert measured.efficiency.compute == costs.efficiency.compute  # what the file leaves out stays
    path.write_text(json.dumps({"efficiency": {"step_floor": 0.004}}))
    with pytest.raises(ValueError, match="efficiency.step_floor"):
        costs.with_cost_file(str(path))


def test_the_kv_pool_holds_the_blocks_nanomm_plan_computes_for_that_model_on_that_gpu():
    """256 sequences, so that the H200's memory, not max_num_seqs x max_model_len, bounds the pool."""
    with LLM(emulate=TWIN, max_num_seqs=256) as llm:
        blocks = llm.engine.config.num_kv_blocks
        assert llm.stats()["kv_blocks_total"] == blocks
    plan = subprocess.run(["nanomm-plan", str(model_folder("qwen2-vl-2b")), "--device-memory",
                           str(GPUS["h200"].memory_gib), "--max-num-seqs", "256", "--json"],
                          capture_output=True, text=True, check=True)
    planned = json.loads(plan.stdout)
    assert planned["num_kv_blocks"] == blocks and "capped" not in planned["budget_rule"]
    assert planned["kv_bytes_per_token"] == 2 * 28 * 2 * 128 * 2  # the real model's KV, not the demo's


def test_a_second_pass_hits_the_prefix_and_encoder_caches_and_answers_the_same(slept):
    with LLM(emulate=TWIN) as llm:
        params = SamplingParams(temperature=0.8, seed=1, max_tokens=8)
        first = [o.outputs[0].token_ids for o in llm.chat(chats(3), params, use_tqdm=False)]
        before = llm.stats()
        second = [o.outputs[0].token_ids for o in llm.chat(chats(3), params, use_tqdm=False)]
        after = llm.stats()
    assert second == first and len(set(map(tuple, first))) == 3  # the stand-in is the request's, not the batch's
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= 3 * 256
    assert after["visual_tokens_encoded"] == before["visual_tokens_encoded"]  # nothing encoded again
    assert after["computed_tokens"] - before["computed_tokens"] < before["computed_tokens"] / 2


def test_a_small_kv_budget_preempts_and_the_answers_do_not_change(slept):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(emulate=TWIN) as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.chat(chats(6), params, use_tqdm=False)]
        assert roomy.stats()["preemptions"] == 0
    with LLM(emulate=TWIN, num_kv_blocks=40, block_size=16, enable_prefix_caching=False,
             max_num_batched_tokens=64) as tight:  # six 19-block prompts in 40 blocks, prefilled 64 tokens a step
        got = [o.outputs[0].token_ids for o in tight.chat(chats(6), params, use_tqdm=False)]
        assert tight.stats()["preemptions"] > 0 and tight.stats()["kv_blocks_total"] == 40
    assert got == expected


@pytest.mark.parametrize("value", ["h300:qwen2-vl-2b", "h200:llama-3-8b", "h200", "qwen2-vl-2b:h200", ""])
def test_a_bad_emulate_value_is_an_error_naming_the_known_ones(value):
    with pytest.raises(ValueError, match=r"GPU one of \['a100', 'h100', 'h200', 'h800', 'l4'\] and MODEL one of "
                                         r"\['qwen2-vl-2b', 'qwen2.5-vl-3b', 'qwen3-vl-2b', 'qwen3-vl-4b'\]"):
        LLM(emulate=value)


def test_the_server_refuses_a_bad_emulate_value_before_starting():
    done = subprocess.run(["nanomm-serve", "--emulate", "h300:qwen2-vl-2b", "--port", "1"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "h200" in done.stderr and "qwen2-vl-2b" in done.stderr
    done = subprocess.run(["nanomm-serve", "--emulate", TWIN, "--demo", "--port", "1"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and "loads no model" in done.stderr


def test_a_model_argument_must_name_the_emulated_model():
    with pytest.raises(ValueError, match="serves qwen2-vl-2b"):
        LLM("Qwen/Qwen2.5-VL-3B-Instruct", emulate=TWIN)


def test_an_emulated_server_answers_over_http_with_the_real_model_s_metrics():
    """The OpenAI route and /metrics of a twin: the pool is the H200's, a picture costs qwen2-vl-2b's tokens."""
    import base64
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (448, 448), "red").save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    with LLM(emulate=TWIN) as llm, BackgroundServer(Server(llm, ServerConfig(TWIN))) as base:
        chat = {"model": TWIN, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it"}]}]}
        reply = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).json()
        metrics = httpx.get(base + "/metrics").text
    assert reply["usage"]["completion_tokens"] == 5 and reply["usage"]["visual_tokens"] == 256
    assert f"nanomm_kv_blocks_total {float(llm.engine.config.num_kv_blocks)}" in metrics


def test_the_image_path_never_imports_the_emulated_device():
    code = ("import sys, nanomm; from nanomm import LLM, SamplingParams; "
            "LLM(nanomm.demo_checkpoint(), device='cpu').generate('hi', SamplingParams(max_tokens=2), use_tqdm=False); "
            "assert not [m for m in sys.modules if m.startswith('nanomm.emulate')], 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_load_generator_drives_an_emulated_server(tmp_path):
    """`nanomm-bench load --emulate` starts nanomm-serve --emulate and measures it: every request answered, each
    picture qwen2-vl-2b's 256 visual tokens (448x448), the JSON complete. A bad value stops it before it starts."""
    out = tmp_path / "twin.json"
    done = subprocess.run([sys.executable, "-m", "nanomm.bench", "load", "--emulate", TWIN, "--mix", "1x448x448:1,0x0x0:1",
                           "--rate", "20", "--num-requests", "8", "--max-tokens", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    (result,) = json.loads(out.read_text())["results"]
    assert result["errors"] == 0 and len(result["records"]) == 8
    assert {r["visual_tokens"] for r in result["records"]} <= {0, 256}
    bad = subprocess.run([sys.executable, "-m", "nanomm.bench", "load", "--emulate", "h200:nope"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "qwen2-vl-2b" in bad.stderr


DRAFT = {"method": "draft", "model": "x", "num_speculative_tokens": 2}


@pytest.mark.parametrize("setting, named", [(dict(quantization="int8"), "quantization"),
                                            (dict(speculative=DRAFT), "a draft model"),
                                            (dict(dtype="float32"), "dtype"), (dict(max_model_len=10**7), "max_model")])
def test_what_the_twin_does_not_emulate_is_refused_by_name(setting, named):
    with pytest.raises(ValueError, match=named):
        LLM(emulate=TWIN, **setting)


def test_the_stand_in_answers_by_request_picture_and_seed(slept):
    """Unseeded samples differ from each other; the same words about two pictures differ; a seed or greedy
    decoding repeats itself; past the drawn length, min_tokens gets ordinary tokens, never a special one."""
    with LLM(emulate=TWIN) as llm:
        special = set(llm.tokenizer.special_token_ids) if hasattr(llm.tokenizer, "special_token_ids") else set()
        sampled = llm.generate(["hi"], SamplingParams(n=3, temperature=1.0, max_tokens=6), use_tqdm=False)[0]
        assert len({tuple(c.token_ids) for c in sampled.outputs}) == 3
        two = llm.chat(chats(2, words="same words"), SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        assert two[0].outputs[0].token_ids != two[1].outputs[0].token_ids
        greedy = [llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
                  .outputs[0].token_ids for _ in range(2)]
        assert greedy[0] == greedy[1]
        long = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=600, min_tokens=600),
                            use_tqdm=False)[0].outputs[0]
        model = llm.model.config
    assert len(long.token_ids) == 600 and long.finish_reason == "length"
    assert not set(long.token_ids) & ({model.image_token_id, model.vision_start_token_id,
                                      model.vision_end_token_id, *model.eos_token_ids} | special)


def test_an_emulated_encoder_service_feeds_an_emulated_engine(slept):
    """1E1PD on the twin: the engine runs no tower; the service's tower takes the cost model's time; the bytes
    counted on both sides are the real model's visual tokens (256 tokens x 1536 x 2 bytes a 448x448 picture)
    while placeholders cross; the answers are the integrated twin's."""
    from nanomm.serve.encoder_server import EncoderServer, load_emulated_encoder

    params = SamplingParams(temperature=0, max_tokens=6)
    with LLM(emulate=TWIN) as whole:
        expected = [o.outputs[0].token_ids for o in whole.chat(chats(2), params, use_tqdm=False)]
    service = load_emulated_encoder(TWIN, sleep=slept.append)
    with BackgroundServer(EncoderServer(service, TWIN)) as url, LLM(emulate=TWIN, encoder_url=url) as split:
        got = [o.outputs[0].token_ids for o in split.chat(chats(2), params, use_tqdm=False)]
        stats = split.stats()
        metrics = httpx.get(url + "/metrics").text
    real_bytes = 2 * 256 * 1536 * 2
    assert got == expected
    assert stats["visual_tokens_encoded"] == 0 and len(split.engine.runner.encode_seconds) == 0  # no local tower
    assert split.engine.runner.encode_s == 0.0  # and no step waited for the service: the tokens came ahead
    assert stats["visual_token_bytes_received"] == real_bytes
    sent = next(line for line in metrics.splitlines()
                if line.startswith('nanomm_visual_token_transfer_bytes_total{direction="sent"}'))
    assert float(sent.split()[-1]) == real_bytes
    assert "nanomm_encoder_visual_tokens_total 512.0" in metrics
    costs = split.emulated.costs
    assert sorted(sum(service.tower.patches, [])) == [1024, 1024]  # each request's picture, fetched ahead
    assert service.tower.seconds == [costs.encode_seconds(batch) for batch in service.tower.patches]  # a batch's time
    assert slept.count(costs.transfer_seconds(real_bytes // 2)) >= 2  # each one's link time, waited by the engine



def data_url_of(picture: Image.Image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_a_1e1p1d_handoff_on_the_twin_moves_the_real_model_s_bytes(monkeypatch):
    """Encoder, prefill and decode instances of the twin behind the real router: the answer is the integrated
    twin's; /metrics of each side counts the bytes qwen2-vl-2b's tensors would take (visual tokens 256 x 1536 x 2,
    KV 28 layers x 2 x 2 heads x 128 x 2 a position) while placeholders cross; the decode side sleeps the KV's
    link time; the prefill instance's blocks go back to its pool."""
    from family_checks import metric
    from nanomm.emulate.runner import EmulatedKVConnector
    from nanomm.serve.encoder_server import EncoderServer, load_emulated_encoder
    from nanomm.serve.router import Router

    link_waits = []
    monkeypatch.setattr(EmulatedKVConnector, "wait", lambda connector, s: link_waits.append(s))
    monkeypatch.setattr(EmulatedRunner, "wait", lambda runner, s: None)
    chat = {"model": TWIN, "max_tokens": 6, "temperature": 0.0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url_of(Image.new("RGB", (448, 448), "red"))}},
        {"type": "text", "text": "what is it"}]}]}
    service = load_emulated_encoder(TWIN, sleep=lambda s: None)
    with LLM(emulate=TWIN) as whole_llm, BackgroundServer(Server(whole_llm, ServerConfig(TWIN))) as whole_url, \
            BackgroundServer(EncoderServer(service, TWIN)) as encoder_url, \
            LLM(emulate=TWIN, encoder_url=encoder_url) as prefill, LLM(emulate=TWIN) as decode, \
            BackgroundServer(Server(prefill, ServerConfig(TWIN, role="prefill", encoder_urls=(encoder_url,)))) \
            as prefill_url, BackgroundServer(Server(decode, ServerConfig(TWIN, role="decode"))) as decode_url, \
            BackgroundServer(Router([encoder_url], [prefill_url], [decode_url])) as router_url:
        whole = httpx.post(whole_url + "/v1/chat/completions", json=chat, timeout=120).json()
        split = httpx.post(router_url + "/v1/chat/completions", json=chat, timeout=120).json()
        sent, received = (httpx.get(url + "/metrics").text for url in (prefill_url, decode_url))
        prefill_blocks = prefill.stats()["kv_blocks_used"]
    assert split["choices"][0]["message"] == whole["choices"][0]["message"]
    assert split["usage"]["completion_tokens"] == 6 and split["usage"]["visual_tokens"] == 256
    prompt_tokens = split["usage"]["prompt_tokens"]
    kv_bytes = prompt_tokens * 28 * 2 * 2 * 128 * 2
    assert metric(sent, 'nanomm_kv_transfer_bytes_total{direction="sent"}') == kv_bytes
    assert metric(received, 'nanomm_kv_transfer_bytes_total{direction="received"}') == kv_bytes
    assert metric(sent, 'nanomm_visual_token_transfer_bytes_total{direction="received"}') == 256 * 1536 * 2
    assert link_waits == [decode.emulated.costs.transfer_seconds(kv_bytes)]
    assert prefill_blocks == 0  # the parked blocks left with the pull


@pytest.mark.slow
def test_lesson_13_s_five_role_command_lines_run_on_the_twin():
    """The lesson's command lines as written (on free ports): a chat with a picture through the router, and one
    to the E+PD engine, each answered with qwen2-vl-2b's 256 visual tokens."""
    import re
    import time
    from pathlib import Path

    from nanomm.serve.testing import free_local_port

    lesson = (Path(__file__).resolve().parents[1] / "lessons" / "13-three-topologies.md").read_text()
    block = next(b for b in re.findall(r"```text\n(.*?)```", lesson, re.S) if "--emulate h200:qwen2-vl-2b --role" in b)
    lines = [" ".join(line.split("#")[0].split()) for line in block.replace("\\\n", " ").splitlines()
             if line.strip()]
    ports = {port: str(free_local_port()) for port in ("8000", "8001", "8002", "8003", "8004")}
    commands = [re.sub(r"\b(800[0-4])\b", lambda m: ports[m.group(1)], line).split() for line in lines]
    assert len(commands) == 5 and all(c[0] == "nanomm-serve" for c in commands)
    processes = [subprocess.Popen(c + ["--log-level", "warning"], stdout=subprocess.DEVNULL) for c in commands]
    try:
        for port in ports.values():
            for _ in range(600):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            else:
                raise AssertionError(f"port {port} never answered")
        chat = {"max_tokens": 4, "temperature": 0.0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url_of(Image.new("RGB", (448, 448), "blue"))}},
            {"type": "text", "text": "what is it"}]}]}
        for front in (ports["8000"], ports["8004"]):  # the router, the E+PD engine
            reply = httpx.post(f"http://127.0.0.1:{front}/v1/chat/completions", json=chat, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["visual_tokens"] == 256 and reply.json()["usage"]["completion_tokens"] == 4
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)

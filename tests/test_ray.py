"""nanomm on Ray Serve (nanomm/serve/ray.py), on a real local Ray cluster bound to 127.0.0.1.

The README's `serve run` line serves the demo model and answers image chats with the integrated server's
tokens; a decode replica killed mid-stream gives the client an error event and comes back; the `load` policy
grows the pool whose load grows; bad arguments fail before any replica starts. Without the [ray] extra these
tests skip, saying so."""

import os
import shlex
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

# Ray's switch for a one-machine cluster: every Ray process binds and dials 127.0.0.1 (not the machine's network
# address). Read when ray is imported, and inherited by the cluster's processes and `serve run`.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve", reason="the [ray] extra is not installed (pip install -e '.[ray]')")

from nanomm.serve.app import Server, ServerConfig  # noqa: E402
import nanomm.serve.ray  # noqa: E402
from nanomm.serve.app_spec import AppSpec  # noqa: E402
from nanomm.serve.ray import app  # noqa: E402
from nanomm.serve.testing import BackgroundServer, free_local_port  # noqa: E402
from test_disagg_processes import MODEL, answer  # noqa: E402
from test_serve import metrics, png_url, readme_block, user  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster (its own GCS, raylet and workers) on 127.0.0.1, with Serve's proxy on a free port."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    port = free_local_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield {"url": f"http://127.0.0.1:{port}", "address": ray.get_runtime_context().gcs_address, "port": port}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def deployed(cluster):
    """serve.run(app(args)) as the one application; deleted afterwards."""
    def run(**args):
        serve.start(http_options={"host": "127.0.0.1", "port": cluster["port"]})  # again after `serve run` ended
        serve.run(app(args), name="nanomm", route_prefix="/")
        return cluster["url"]

    yield run
    serve.delete("nanomm")


def readme_serve_run() -> list[str]:
    block = readme_block("bash", "serve run nanomm.serve.ray:app")
    line = next(line for line in block.splitlines() if line.startswith("serve run") and "demo=" in line)
    return shlex.split(line.split("#")[0])


def test_the_readme_s_serve_run_line_answers_as_the_integrated_server(cluster, tmp_path):
    """`serve run` as the README has it, attached to the cluster: image chats, whole and streamed, greedy and
    seeded, get the integrated server's tokens and logprobs through the openai client."""
    command = readme_serve_run()
    env = {**os.environ, "RAY_ADDRESS": cluster["address"], "NANOMM_CACHE": str(tmp_path)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    from nanomm import LLM, demo_checkpoint

    integrated = Server(LLM(str(demo_checkpoint())), ServerConfig(MODEL))
    try:
        deadline = time.monotonic() + 180
        while not _healthy(cluster["url"]):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "serve run did not come up in 180 s"
            time.sleep(1)
        with BackgroundServer(integrated) as oracle:
            for stream in (False, True):
                for sampling in (dict(temperature=0), dict(temperature=1.0, seed=11)):
                    tokens, logprobs, finish = answer(oracle, stream, **sampling)
                    their_tokens, their_logprobs, their_finish = answer(cluster["url"], stream, **sampling)
                    assert (their_tokens, their_finish) == (tokens, finish) and len(tokens) == 12
                    assert their_logprobs == pytest.approx(logprobs, abs=1e-5)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)  # `serve run` deletes its application, and Serve, as it ends
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        # A `serve run` killed before it cleaned up leaves its application on "/", where the next tests deploy.
        serve.start(http_options={"host": "127.0.0.1", "port": cluster["port"]})
        serve.delete("default")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_decode_replica_killed_mid_stream_is_an_error_event_and_comes_back(deployed):
    url = deployed(topology="1e1p1d", emulate="l4:qwen2.5-vl-3b", kv_handoff_timeout_s="3", peer_timeout_s="10")
    body = {"model": "l4:qwen2.5-vl-3b", "messages": user("Tell me about it.", png_url(3, 84, 84)),
            "max_tokens": 2000, "stream": True, "ignore_eos": True}
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as stream:
        events = stream.iter_lines()
        first = next(line for line in events if line.startswith("data: "))
        assert '"content"' in first
        old = _replica_actors("decode")
        assert len(old) == 1
        ray.kill(ray.get_actor(old[0], namespace="serve"))
        rest = [line for line in events if line.startswith("data: ")]
    assert time.monotonic() - start < 30
    assert rest and '"error"' in rest[-1] and "failed mid-stream" in rest[-1]
    deadline = time.monotonic() + 90  # Ray starts another decode replica, which answers
    while not (_replica_actors("decode") and _replica_actors("decode") != old and _answers(url, body)):
        assert time.monotonic() < deadline, "no new decode replica answered within 90 s"
        time.sleep(1)
    prefill = serve.get_deployment_handle("prefill", app_name="nanomm").where.remote().result()
    deadline = time.monotonic() + 20
    while metrics(prefill)[("nanomm_kv_requests_parked", ())] > 0:
        assert time.monotonic() < deadline, "the prefill replica kept parked KV nobody will take"
        time.sleep(0.5)
    assert metrics(prefill)[("nanomm_kv_blocks_used", ())] == 0


def _replica_actors(deployment: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::nanomm#{deployment}#"))


def _answers(url: str, body: dict) -> bool:
    reply = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
    return reply.status_code == 200


def test_the_load_policy_grows_the_pools_whose_load_grows(deployed):
    """Pictures arrive at ~1,000 visual tokens a second; the encoder and prefill replicas are given a capacity
    of 500 (at utilization 1), the decode replicas one of 64 sequences: Ray's controller grows the encoder and
    prefill pools, and the decode pool stays at one replica."""
    url = deployed(topology="1e1p1d", emulate="h200:qwen2-vl-2b", policy="load", max_replicas="3",
                   encoder_capacity="500", prefill_capacity="500", decode_capacity="64", utilization="1",
                   upscale_delay_s="1", look_back_period_s="2", window_s="4")
    body = {"model": "h200:qwen2-vl-2b", "max_tokens": 2}
    deadline = time.monotonic() + 60
    seed = 0
    with httpx.Client(timeout=30) as client:
        while _targets()["prefill"] < 2 or _targets()["encoder"] < 2:
            assert time.monotonic() < deadline, f"the pools did not grow: {_targets()}"
            for _ in range(4):  # 448 x 448: 256 visual tokens each, 4 a second
                seed += 1
                reply = client.post(url + "/v1/chat/completions",
                                    json={**body, "messages": user("What is it?", png_url(seed, 448, 448))})
                assert reply.status_code == 200, reply.text
            time.sleep(0.5)
    assert _targets()["decode"] == 1


def test_under_the_shifting_day_the_load_policy_grows_each_pool_in_its_own_phase(cluster):
    """`nanomm-bench day`'s run, the day at half length, policy load, on emulated L4s: from the Ray
    controller's replica counts, the encoder and prefill pools grow in the pages phase while the decode pool
    stays at one, and the decode pool grows in the long answers' phase."""
    from nanomm.bench import cli
    from nanomm.bench import day as autoscale_day
    from nanomm.bench.load import TRACES

    args = cli.parse(autoscale_day, ["--policy", "load", "--time-scale", "0.5"])
    trace = tuple(replace(p, seconds=p.seconds * 0.5) for p in TRACES["day"])
    serve.start(http_options={"host": "127.0.0.1", "port": cluster["port"]})  # again after `serve run` ended
    run = autoscale_day.run_policy("load", args, trace, cluster["url"])
    peaks = run["most_replicas_by_phase"]
    assert peaks["chat"] == {"encoder": 1, "prefill": 1, "decode": 1}
    assert peaks["pages"]["encoder"] >= 2 and peaks["pages"]["prefill"] >= 2 and peaks["pages"]["decode"] == 1
    assert peaks["long answers"]["decode"] >= 2
    assert run["errors"] == 0


def _targets() -> dict[str, int]:
    deployments = serve.status().applications["nanomm"].deployments
    return {name: sum(status.replica_states.values()) for name, status in deployments.items()}


@pytest.mark.parametrize("args, words", [
    ({"topology": "e+p+d+x", "demo": "trained"}, "unknown topology 'e+p+d+x'"),
    ({"topology": "epd", "demo": "trained"}, "integrated, dp<N>, <X>e<Y>pd or <X>e<Y>p<Z>d"),  # the one grammar
    ({"topology": "1e1pd", "demo": "trained"}, "nanomm on Ray serves dp<N> (integrated) and <X>e<Y>p<Z>d"),
    ({"topology": "1e3p1d", "demo": "trained", "max_replicas": "2"}, "more than max_replicas=2"),
    ({"topology": "1e1p1d", "demo": "trained", "policy": "rps"}, "unknown autoscaling policy 'rps'"),
    ({"topology": "1e1p1d", "model": "/nowhere/qwen"}, "/nowhere/qwen"),
    ({"topology": "1e1p1d"}, "give exactly one of model="),
    ({"topology": "1e1p1d", "demo": "trained", "policy": "load"}, "policy=load needs encoder_capacity="),
    ({"topology": "1e1p1d", "demo": "trained", "replicas": "3"}, "unknown argument(s) ['replicas']"),
])
def test_bad_arguments_fail_before_any_replica_starts(args, words, monkeypatch):
    built = []
    monkeypatch.setattr(nanomm.serve.ray, "build", built.append)
    with pytest.raises(ValueError) as error:
        app(args)
    assert words in str(error.value)
    assert built == []  # no deployment was even described, so none can start


def test_arguments_arrive_as_strings_and_are_typed():
    spec = AppSpec.from_args({"emulate": "h200:qwen2-vl-2b", "max_replicas": "4", "utilization": "0.5"})
    assert (spec.max_replicas, spec.utilization, spec.topology) == (4, 0.5, "1e1p1d")


def test_the_serve_deploy_yaml_names_this_application_and_its_arguments_build_it():
    import yaml  # Ray Serve's own dependency

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "scripts" / "ray_serve.yaml").read_text())
    [application] = config["applications"]
    assert application["import_path"] == "nanomm.serve.ray:app"
    assert config["http_options"]["host"] == "127.0.0.1"
    spec = AppSpec.from_args({k: str(v) for k, v in application["args"].items()})
    assert (spec.topology, spec.policy, spec.max_replicas) == ("1e1p1d", "load", 4)
    assert app(application["args"]) is not None  # every pool's capacity known, the deployments described


def test_the_least_work_router_ranks_replicas_by_the_work_they_hold():
    """Ray calls on_request_routed and on_request_completed around each call; the router ranks by what is left."""
    import asyncio
    from types import SimpleNamespace

    from nanomm.serve.ray import LeastWorkRouter

    router = object.__new__(LeastWorkRouter)  # the state alone: Ray's own __init__ wires it to a deployment
    router.initialize_state()
    a, b, c = (SimpleNamespace(replica_id=name) for name in "abc")

    def routed(request_id: str, replica, work: float):
        call = SimpleNamespace(kwargs={"work": work}, metadata=SimpleNamespace(internal_request_id=request_id))
        router.on_request_routed(call, replica.replica_id, None)

    def ranking():
        return [rank[0].replica_id for rank in asyncio.run(router.choose_replicas([a, b, c]))]

    assert ranking() == ["a", "b", "c"]  # nothing held: the first of equals first
    routed("page", a, 2500)
    routed("chat 1", b, 0)
    routed("thumbnail", c, 64)
    assert ranking() == ["b", "c", "a"]
    router.on_request_completed("a", "page")
    assert ranking() == ["a", "b", "c"]  # a and b hold nothing again; c still its thumbnail

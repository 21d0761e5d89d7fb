"""The split engine as its users run it: real `nanomm-serve` processes on 127.0.0.1 (an encoder service, a
prefill and a decode instance behind a router; an engine with a remote encoder; one integrated server as the
oracle), spoken to with the openai client. Then a decode instance killed mid-stream."""

import os
import re
import shlex
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from test_serve import free_port, metrics, png_url, readme_block, user, wait_for_health

pytestmark = pytest.mark.slow
SERVE = [shutil.which("nanomm-serve") or "nanomm-serve"]  # the console script the README's set-up installs
MODEL = "nanomm-demo"


class Processes:
    """Named nanomm-serve processes, each on its own free port; all stopped at the end."""

    def __init__(self, tmp_path):
        self.env = {**os.environ, "NANOMM_CACHE": str(tmp_path)}
        self.urls, self.procs = {}, {}

    def start(self, name: str, *args: str, port: str | None = None) -> str:
        """nanomm-serve with these arguments; on a free port unless args name one (then give it as `port`)."""
        port = port or str(free_port())
        extra = [] if "--port" in args else ["--port", port]
        self.procs[name] = subprocess.Popen([*SERVE, *args, *extra, "--log-level", "warning"],
                                            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.urls[name] = f"http://127.0.0.1:{port}"
        return self.urls[name]

    def wait(self) -> None:
        for name, url in self.urls.items():
            wait_for_health(url, self.procs[name])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _repoint(arg: str, free: dict[str, str]) -> str:
    if arg.startswith("http://127.0.0.1:"):
        return "http://127.0.0.1:" + free[arg.rsplit(":", 1)[1]]
    return arg


def start_split(procs: Processes, kv_handoff_timeout: str = "30") -> None:
    encoder = procs.start("encoder", "--demo", "--role", "encoder")
    prefill = procs.start("prefill", "--demo", "--role", "prefill", "--encoder-url", encoder,
                          "--kv-handoff-timeout", kv_handoff_timeout)
    decode = procs.start("decode", "--demo", "--role", "decode")
    procs.start("router", "--role", "router", "--encoder-url", encoder, "--prefill-url", prefill,
                "--decode-url", decode, "--peer-timeout", "10")


def readme_commands() -> dict[str, list[str]]:
    """The README's five split-engine command lines, by role, as written (ports and all)."""
    block = readme_block("bash", "--role router").replace("\\\n", " ")
    commands = [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.startswith("nanomm-serve")]
    roles = [c[c.index("--role") + 1] if "--role" in c else "1e1pd" for c in commands]
    return dict(zip(roles, commands))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """The README's five command lines, on free ports (the README's ports rewritten everywhere), and one
    integrated server as the oracle."""
    procs = Processes(tmp_path_factory.mktemp("split"))
    commands = readme_commands()
    assert sorted(commands) == ["1e1pd", "decode", "encoder", "prefill", "router"]
    ports = {arg.rsplit(":", 1)[1] for c in commands.values() for arg in c if arg.startswith("http://127.0.0.1:")}
    ports |= {c[c.index("--port") + 1] for c in commands.values()}
    free = {port: str(free_port()) for port in ports}
    for role, command in commands.items():
        args = [free.get(a, a) if a.isdigit() else _repoint(a, free) for a in command[1:]]
        procs.start(role, *args, port=free[command[command.index("--port") + 1]])
    procs.start("integrated", "--demo")
    try:
        procs.wait()
        yield procs.urls
    finally:
        procs.stop()


def answer(base: str, stream: bool, **sampling) -> tuple[list[str], list[float], str]:
    """(tokens, their logprobs, finish reason) of one image chat, through the openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)
    messages = user("What colour is the circle? Then say more.", png_url(7, 112, 112))
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, logprobs=True,
                                           stream=stream, extra_body={"ignore_eos": True}, **sampling)
    if not stream:
        choice = reply.choices[0]
        return [t.token for t in choice.logprobs.content], [t.logprob for t in choice.logprobs.content], \
            choice.finish_reason
    tokens, logprobs, finish = [], [], None
    for chunk in reply:
        for choice in chunk.choices:
            for t in (choice.logprobs.content if choice.logprobs else None) or []:
                tokens.append(t.token), logprobs.append(t.logprob)
            finish = choice.finish_reason or finish
    return tokens, logprobs, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=11)], ids=["greedy", "seeded"])
def test_the_router_and_1e1pd_answer_as_one_engine(deployment, stream, sampling):
    tokens, logprobs, finish = answer(deployment["integrated"], stream, **sampling)
    assert len(tokens) == 12 and finish == "length"
    for front in ("router", "1e1pd"):
        their_tokens, their_logprobs, their_finish = answer(deployment[front], stream, **sampling)
        assert their_tokens == tokens and their_finish == finish, front
        assert their_logprobs == pytest.approx(logprobs, abs=1e-5), front


def test_each_role_shows_its_own_work_and_the_bytes_it_moved(deployment):
    answer(deployment["router"], False, temperature=0)
    answer(deployment["1e1pd"], False, temperature=0)
    time.sleep(0.5)  # the engines publish their stats between steps
    m = {name: metrics(url) for name, url in deployment.items() if name != "router"}

    def value(name, metric, direction=None):
        return m[name].get((metric, (("direction", direction),) if direction else ()), 0.0)

    tokens = "nanomm_encoder_visual_tokens_total"
    assert value("encoder", tokens) > 0 and value("integrated", tokens) > 0
    assert value("prefill", tokens) == 0 and value("1e1pd", tokens) == 0 and value("decode", tokens) == 0
    visual, kv = "nanomm_visual_token_transfer_bytes_total", "nanomm_kv_transfer_bytes_total"
    received = value("prefill", visual, "received") + value("1e1pd", visual, "received")
    assert value("encoder", visual, "sent") == received > 0
    assert value("prefill", kv, "sent") == value("decode", kv, "received") > 0
    assert value("integrated", kv, "sent") == value("integrated", visual, "received") == 0
    assert value("prefill", "nanomm_kv_blocks_used") == 0
    assert m["decode"][("nanomm_ttft_transfer_seconds_count", ())] > 0


def test_bad_input_is_the_same_400_at_the_router(deployment):
    body = {"model": MODEL, "messages": user("hi", "data:image/png;base64,bm90IGFuIGltYWdl"), "max_tokens": 3}
    direct = httpx.post(deployment["integrated"] + "/v1/chat/completions", json=body, timeout=30)
    routed = httpx.post(deployment["router"] + "/v1/chat/completions", json=body, timeout=30)
    assert direct.status_code == routed.status_code == 400
    def message(reply):  # the request id differs, the rest is the same words
        return re.sub(r"chatcmpl-[0-9a-f]+", "ID", reply.json()["error"]["message"])

    assert message(routed) == message(direct) and "image 0" in message(direct)


def test_a_decode_instance_killed_mid_stream(tmp_path):
    """The client gets an error, not a hang; the router then answers 5xx at once; the prefill instance's KV
    blocks go back to 0, also those of a request whose decode peer never came."""
    procs = Processes(tmp_path)
    start_split(procs, kv_handoff_timeout="3")
    try:
        procs.wait()
        body = {"model": MODEL, "messages": user("Tell me about it.", png_url(3, 84, 84)), "max_tokens": 2000,
                "stream": True, "ignore_eos": True}
        start = time.monotonic()
        with httpx.stream("POST", procs.urls["router"] + "/v1/chat/completions", json=body, timeout=60) as stream:
            events = stream.iter_lines()
            first = next(line for line in events if line.startswith("data: "))
            assert '"content"' in first
            procs.procs["decode"].kill()
            rest = [line for line in events if line.startswith("data: ")]
        assert time.monotonic() - start < 30
        assert rest and '"error"' in rest[-1] and "failed mid-stream" in rest[-1]
        again = httpx.post(procs.urls["router"] + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
        assert again.status_code in (502, 503, 504) and "decode instance" in again.json()["error"]["message"]
        deadline = time.monotonic() + 15  # the second request's KV was parked for a peer that is gone
        while metrics(procs.urls["prefill"])[("nanomm_kv_blocks_used", ())] > 0:
            assert time.monotonic() < deadline, "the prefill instance kept KV blocks nobody will take"
            time.sleep(0.5)
    finally:
        procs.stop()

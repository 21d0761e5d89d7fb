"""nanomm-top (nanomm/serve/top.py): a frame drawn from a live server shows the numbers its own /metrics has; the
rates, quantiles, means and bars by hand on two written scrapes; an unreachable instance is a row, not a
traceback; a router's pools, each instance scraped; the command's --once and --files."""

import base64
import io
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

import nanomm.serve
from nanomm import LLM, demo_checkpoint
from nanomm.serve import top
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.encoder_server import EncoderServer, load_encoder
from nanomm.serve.router import Router
from nanomm.serve.testing import BackgroundServer, free_local_port

GPU_HOURLY_PRICE = 3.6  # dollars an hour: a device second costs $0.001


# -- helpers --------------------------------------------------------------------------------------------------

def frame_text(view: top.View) -> str:
    console = Console(record=True, width=120)
    console.print(top.render(view))
    return console.export_text()


def frame_rows(text: str) -> dict[str, dict[str, list[str]]]:
    """Each block's rows ("load", "requests", "TTFT"), keyed by instance (host:port), as their words."""
    blocks: dict[str, dict[str, list[str]]] = {}
    block = None
    for words in (line.split() for line in text.splitlines()):
        if words and words[0] in ("load", "requests", "TTFT"):
            block = blocks.setdefault(words[0], {})
        elif block is not None and len(words) > 2 and words[:2] != ["role", "instance"]:
            block[words[1]] = words
    return blocks


def host(url: str) -> str:
    return url.split("://", 1)[1]


def read_metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name, summed over its labels (the test's own reading, not top's), but the host's
    CPU seconds, which grow with every scrape."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if "le" not in sample.labels and sample.name != "nanomm_host_cpu_seconds_total":
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def png_data_url(width: int = 56, height: int = 56) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "tomato").save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(url: str, content) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def send_two_requests(url: str) -> int:
    """One chat with a picture, one without; the visual tokens the server says they had."""
    with_picture = chat(url, [{"type": "image_url", "image_url": {"url": png_data_url()}},
                              {"type": "text", "text": "What colour is this?"}])
    text_only = chat(url, "Hello!")
    return with_picture["usage"]["visual_tokens"] + text_only["usage"]["visual_tokens"]


def wait_until_settled(url: str, timeout_s: float = 10.0) -> None:
    """The engine thread publishes its stats just after it hands the last output over: wait (bounded) until
    nothing runs and two reads of /metrics agree, so that top's scrape and the test's read the same numbers."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        values = read_metrics(url)
        if values == previous and values["nanomm_requests_running"] == values["nanomm_kv_blocks_used"] == 0:
            return
        assert time.monotonic() < deadline, "the server's stats did not settle"
        previous = values
        time.sleep(0.02)


def expected_rate(before: dict, after: dict, name: str, seconds: float, fmt) -> str:
    return fmt((after[name] - before[name]) / seconds) if name in after else "-"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}ms"


@pytest.fixture
def demo_server():
    """The demo model behind nanomm-serve on 127.0.0.1 (a free port), pricing requests; yields (llm, url)."""
    llm = LLM(str(demo_checkpoint()), device="cpu", dtype="float32")
    with BackgroundServer(Server(llm, ServerConfig("nanomm-demo", gpu_hourly_price=GPU_HOURLY_PRICE))) as url:
        yield llm, url


# -- a live server ----------------------------------------------------------------------------------------------

def test_a_frame_from_a_live_server_shows_the_numbers_of_its_own_metrics(demo_server):
    llm, url = demo_server
    with httpx.Client(timeout=10) as client:
        first = top.scrape_target(client, url)
        before = read_metrics(url)  # nothing runs between the two reads
        visual_tokens = send_two_requests(url)
        wait_until_settled(url)
        second = top.scrape_target(client, url)
        after = read_metrics(url)
    seconds = second.target.taken_at - first.target.taken_at
    rows = frame_rows(frame_text(top.compute_view(first, second)))
    me = host(url)
    assert visual_tokens > 0 and after["nanomm_visual_tokens_total"] - before["nanomm_visual_tokens_total"] == \
        visual_tokens

    load = rows["load"][me]
    kv_total = llm.engine.stats()["kv_blocks_total"]
    assert after["nanomm_kv_blocks_total"] == kv_total
    assert load[:4] == ["integrated", me, "0", "0"]  # role (from /health), running, waiting
    assert load[5] == f"0/{kv_total}"  # load[4] is the bar
    failures = after.get("nanomm_kv_allocation_failures_total")
    assert load[6] == ("-" if failures is None else f"{failures:.0f}")
    percent = lambda x: f"{100 * x:.1f}%"
    assert load[7] == expected_rate(before, after, "nanomm_encoder_busy_seconds_total", seconds, percent)
    assert load[8] == expected_rate(before, after, "nanomm_lm_busy_seconds_total", seconds, percent)
    assert load[9] == f"{visual_tokens / seconds:.1f}"
    assert load[10] == expected_rate(before, after, "nanomm_generation_tokens_total", seconds, lambda x: f"{x:.1f}")
    assert load[11:] == [percent(after["nanomm_prefix_cache_hit_rate"]),
                         percent(after["nanomm_encoder_cache_hit_rate"])]

    requests = rows["requests"][me]
    assert requests[2:6] == ["2", "-", f"{seconds:.1f}s", "2"]  # finished, router work, window, its requests
    assert after["nanomm_requests_total"] == 2
    means = {name: (after[name + "_sum"] - before.get(name + "_sum", 0.0)) / 2
             for name in ("nanomm_request_visual_tokens", "nanomm_request_device_seconds",
                          "nanomm_request_cost_dollars", "nanomm_time_to_first_token_seconds",
                          *(f"nanomm_ttft_{stage}_seconds" for stage in top.TTFT_STAGES))}
    assert means["nanomm_request_visual_tokens"] == visual_tokens / 2
    assert requests[8:] == [f"{visual_tokens / 2:.1f}", ms(means["nanomm_request_device_seconds"]),
                            f"${means['nanomm_request_cost_dollars']:.3g}"]
    assert means["nanomm_request_cost_dollars"] == pytest.approx(means["nanomm_request_device_seconds"] / 1000)

    stages = rows["TTFT"][me]
    ttft = means["nanomm_time_to_first_token_seconds"]
    assert stages[2] == ms(ttft)
    shown = stages[3:]  # bar, mean, bar, mean, ...
    assert shown[1::2] == [ms(means[f"nanomm_ttft_{stage}_seconds"]) for stage in top.TTFT_STAGES]
    for stage, drawn in zip(top.TTFT_STAGES, shown[0::2]):
        assert drawn == top.bar(means[f"nanomm_ttft_{stage}_seconds"] / ttft, top.STAGE_BAR)


# -- the numbers by hand ----------------------------------------------------------------------------------------

def histogram(name: str, buckets: dict[str, float], total: float) -> str:
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{le}"}} {count}' for le, count in buckets.items()]
    return "\n".join(lines + [f"{name}_sum {total}", f"{name}_count {buckets['+Inf']}"])


def written_scrape(lm_busy, encoder_busy, visual, generated, ttft_buckets, ttft_sum, stage_sums, request_visual,
                   device_sum) -> str:
    count = ttft_buckets["+Inf"]
    parts = [
        "# TYPE nanomm_kv_blocks_used gauge\nnanomm_kv_blocks_used 30",
        "# TYPE nanomm_kv_blocks_total gauge\nnanomm_kv_blocks_total 120",
        "# TYPE nanomm_requests_running gauge\nnanomm_requests_running 3",
        "# TYPE nanomm_requests_waiting gauge\nnanomm_requests_waiting 7",
        "# TYPE nanomm_kv_allocation_failures counter\nnanomm_kv_allocation_failures_total 4",
        "# TYPE nanomm_prefix_cache_hit_rate gauge\nnanomm_prefix_cache_hit_rate 0.25",
        f"# TYPE nanomm_lm_busy_seconds counter\nnanomm_lm_busy_seconds_total {lm_busy}",
        f"# TYPE nanomm_encoder_busy_seconds counter\nnanomm_encoder_busy_seconds_total {encoder_busy}",
        f"# TYPE nanomm_visual_tokens counter\nnanomm_visual_tokens_total {visual}",
        f"# TYPE nanomm_generation_tokens counter\nnanomm_generation_tokens_total {generated}",
        "# TYPE nanomm_requests counter",
        f'nanomm_requests_total{{finish_reason="stop"}} {count - 1}',
        'nanomm_requests_total{finish_reason="length"} 1',
        histogram("nanomm_time_to_first_token_seconds", ttft_buckets, ttft_sum),
        histogram("nanomm_request_visual_tokens", {"+Inf": count}, request_visual),
        histogram("nanomm_request_device_seconds", {"+Inf": count}, device_sum),
    ]
    parts += [histogram(f"nanomm_ttft_{stage}_seconds", {"+Inf": count}, total) for stage, total in stage_sums.items()]
    return "\n".join(parts) + "\n"


BEFORE = written_scrape(10.0, 1.0, 1000, 50, {"0.1": 2, "0.2": 4, "0.4": 4, "0.8": 4, "+Inf": 4}, 0.5,
                        {"preprocess": 0.1, "queue": 0.0, "encode": 0.3, "prefill": 0.1}, 200, 0.4)
AFTER = written_scrape(12.5, 1.5, 3000, 300, {"0.1": 2, "0.2": 6, "0.4": 12, "0.8": 14, "+Inf": 14}, 3.5,
                       {"preprocess": 0.7, "queue": 0.0, "encode": 1.8, "prefill": 1.0}, 1200, 2.4)
URL = "http://10.0.0.1:8000"


def written(text: str, taken_at: float) -> top.Scrape:
    snapshot = top.parse_metrics(URL, text, taken_at, role="prefill")
    return top.Scrape(snapshot, (snapshot,))


def test_rates_quantiles_and_means_by_hand_over_two_written_scrapes():
    view = top.compute_view(written(BEFORE, 100.0), written(AFTER, 105.0)).instances[0]
    # counters over the 5 s between the scrapes
    assert view.lm_busy == pytest.approx(0.5)  # 10 -> 12.5 busy seconds
    assert view.encoder_busy == pytest.approx(0.1)  # 1 -> 1.5
    assert view.visual_tokens_per_s == pytest.approx(400.0)  # 1000 -> 3000 tokens
    assert view.output_tokens_per_s == pytest.approx(50.0)  # 50 -> 300
    assert (view.running, view.waiting, view.kv_used, view.kv_total) == (3, 7, 30, 120)
    assert (view.allocation_failures, view.prefix_hit_rate, view.encoder_hit_rate) == (4, 0.25, None)
    assert view.finished == 14  # both finish reasons
    # TTFT over the 10 requests that finished between the scrapes: buckets 0.1: 0, 0.2: 2, 0.4: 8, 0.8: 10
    assert (view.window_s, view.window_requests) == (5.0, 10)
    assert view.ttft_p50 == pytest.approx(0.2 + 0.2 * (5 - 2) / (8 - 2))  # rank 5 in the (0.2, 0.4] bucket
    assert view.ttft_p95 == pytest.approx(0.4 + 0.4 * (9.5 - 8) / (10 - 8))  # rank 9.5 in (0.4, 0.8]
    assert view.ttft_mean == pytest.approx(3.0 / 10)
    assert view.mean_visual_tokens == pytest.approx(1000 / 10)
    assert view.mean_device_s == pytest.approx(2.0 / 10)
    assert view.mean_cost is None  # not exported: no --gpu-hourly-price
    stages = dict(view.stages)
    assert stages["preprocess"] == pytest.approx(0.06) and stages["encode"] == pytest.approx(0.15)
    assert stages["prefill"] == pytest.approx(0.09) and stages["queue"] == 0.0 and stages["transfer"] is None

    row = frame_rows(frame_text(top.compute_view(written(BEFORE, 100.0), written(AFTER, 105.0))))
    me = host(URL)
    assert row["load"][me] == ["prefill", me, "3", "7", "█▌····", "30/120", "4", "10.0%", "50.0%", "400.0",
                               "50.0", "25.0%", "-"]
    assert row["requests"][me] == ["prefill", me, "14", "-", "5.0s", "10", "300.0ms", "700.0ms", "100.0",
                                   "200.0ms", "-"]
    # each stage's bar is its share of the 300 ms mean, 7 characters at most (in eighths of one)
    assert row["TTFT"][me] == ["prefill", me, "300.0ms", "█▍·····", "60.0ms", "·······", "0.0ms",
                               "███▌···", "150.0ms", "██▏····", "90.0ms", "-"]


def test_with_no_request_in_the_window_the_quantiles_are_every_requests():
    same = top.compute_view(written(AFTER, 100.0), written(AFTER, 101.0)).instances[0]
    first = top.compute_view(None, written(AFTER, 100.0)).instances[0]
    for view in same, first:  # cumulative buckets 0.1: 2, 0.2: 6, 0.4: 12, 0.8: 14
        assert (view.window_s, view.window_requests) == (None, 14)
        assert view.ttft_p50 == pytest.approx(0.2 + 0.2 * (7 - 6) / (12 - 6))
        assert view.ttft_p95 == pytest.approx(0.4 + 0.4 * (13.3 - 12) / (14 - 12))
        assert view.mean_device_s == pytest.approx(2.4 / 14)
    assert same.lm_busy == 0.0 and first.lm_busy is None  # a rate needs two scrapes


def test_a_counter_that_went_down_restarted_and_missing_metrics_are_dashes():
    restarted = top.parse_metrics(URL, "# TYPE nanomm_lm_busy_seconds counter\nnanomm_lm_busy_seconds_total 2\n",
                                  102.0)
    assert top.counter_rate(top.parse_metrics(URL, AFTER, 100.0), restarted, "nanomm_lm_busy_seconds_total") == 1.0
    bare = top.parse_metrics(URL, "# TYPE nanomm_kv_blocks_total gauge\nnanomm_kv_blocks_total 8\n", 1.0, "decode")
    view = top.compute_view(top.Scrape(bare, (bare,)), top.Scrape(bare, (bare,)))
    words = frame_rows(frame_text(view))
    me = host(URL)
    assert words["load"][me] == ["decode", me, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert words["requests"][me] == ["decode", me, "-", "-", "all", "-", "-", "-", "-", "-", "-"]


def test_bars_fill_in_eighths_and_clamp():
    assert top.bar(0.0, 4) == "····" and top.bar(1.0, 4) == "████" and top.bar(2.0, 4) == "████"
    assert top.bar(0.5, 4) == "██··" and top.bar(1 / 32, 4) == "▏···" and top.bar(-1.0, 2) == "··"


def test_histogram_quantile_is_prometheus():
    h = top.Histogram(((0.5, 4.0), (1.0, 8.0), (float("inf"), 8.0)), 5.0, 8.0)
    assert h.quantile(0.5) == 0.5  # rank 4: the top of the first bucket
    assert h.quantile(0.25) == 0.25  # rank 2: halfway through (0, 0.5]
    assert h.quantile(0.75) == 0.75
    beyond = top.Histogram(((0.5, 4.0), (1.0, 8.0), (float("inf"), 10.0)), 9.0, 10.0)
    assert beyond.quantile(0.95) == 1.0  # rank 9.5 is past the last finite bound: that bound
    assert top.Histogram(((1.0, 0.0), (float("inf"), 0.0)), 0.0, 0.0).quantile(0.5) is None


# -- unreachable, routers, the command --------------------------------------------------------------------------

def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_local_port()}"  # nothing listens there: connections are refused


def test_an_unreachable_instance_is_a_row_that_says_why():
    url = closed_port_url()
    with httpx.Client(timeout=2) as client:
        scrape = top.scrape_target(client, url)
    assert scrape.target.error.startswith("ConnectError")
    text = frame_text(top.compute_view(None, scrape))
    assert f"{host(url)} unreachable: ConnectError" in text and "Traceback" not in text
    assert list(frame_rows(text)) == ["load"]  # nothing else to show


def test_a_router_frame_has_each_pool_in_order_and_every_instance_scraped(demo_server):
    llm, instance = demo_server
    dead = closed_port_url()
    encoder_service = load_encoder(str(demo_checkpoint()), device="cpu", dtype="float32")
    with BackgroundServer(EncoderServer(encoder_service, "nanomm-demo")) as encoder, \
            BackgroundServer(Router([encoder], [dead], [instance])) as router, httpx.Client(timeout=10) as client:
        send_two_requests(instance)  # straight to the instance: the router routes nothing (its prefill is dead)
        wait_until_settled(instance)
        first = top.scrape_target(client, router)
        view = top.compute_view(first, top.scrape_target(client, router))
    assert [(s.url, s.role) for s in first.instances] == [(encoder, "encoder"), (dead, "prefill"),
                                                          (instance, "decode")]  # the router's labels
    assert view.is_router and view.router.role == "router"
    text = frame_text(view)
    assert text.splitlines()[0] == f"nanomm-top router {router}: 3 instances, 1 unreachable"
    rows = frame_rows(text)
    assert list(rows["load"]) == [host(encoder), host(dead), host(instance)]
    assert rows["load"][host(dead)][2:5] == ["unreachable:", "ConnectError:", "[Errno"]
    kv_total = llm.engine.stats()["kv_blocks_total"]
    assert rows["load"][host(instance)][:6] == ["decode", host(instance), "0", "0", "······", f"0/{kv_total}"]
    assert rows["load"][host(encoder)][2:6] == ["-", "-", "-", "-"]  # an encoder service has no requests nor KV
    assert list(rows["requests"]) == [host(router), host(encoder), host(instance)]  # the router's row first
    assert rows["requests"][host(router)][:2] == ["router", host(router)]
    assert rows["requests"][host(instance)][2:4] == ["2", "0"]  # finished here; the router's outstanding work


def test_main_once_prints_a_frame_and_files_lists_the_shipped_monitoring_files(demo_server, capsys):
    llm, url = demo_server
    assert top.main([url, "--once", "--interval", "0.05"]) == 0
    rows = frame_rows(capsys.readouterr().out)
    assert rows["load"][host(url)][5] == f"0/{llm.engine.stats()['kv_blocks_total']}"
    assert top.main([closed_port_url(), "--once", "--interval", "0.01"]) == 0
    assert "unreachable: ConnectError" in capsys.readouterr().out

    assert top.main(["--files"]) == 0
    printed = [Path(line) for line in capsys.readouterr().out.splitlines()]
    folder = Path(nanomm.serve.__file__).parent / "monitoring"
    assert printed == [folder / name for name in ("rules.yml", "rules_test.yml", "dashboard.json", "prometheus.yml")]
    assert all(path.is_file() for path in printed)


def test_the_command_needs_a_url_and_a_positive_interval(capsys):
    with pytest.raises(SystemExit):
        top.main([])
    with pytest.raises(SystemExit):
        top.main(["http://127.0.0.1:1", "--interval", "0"])

"""`/metrics` in Prometheus' text format: what a dashboard of a multimodal server needs to watch.

Lesson: lessons/11-serving-under-load.md (these metrics under load), lessons/07-encoder-cache.md (TTFT and its
stages), lessons/06-prefix-caching.md (the hit rates).

- Per finished request (from its `RequestMetrics`): histograms of TTFT and of each of its stages (preprocess,
  queue, encode, prefill, and on a decode instance the KV transfer; they add up to TTFT), of TPOT and of end-to-end time; counters of prompt, visual and
  generated tokens, and of requests by finish reason. `rate(nanomm_visual_tokens_total[1m])` is the visual
  tokens per second to scale on.
- Per finished request, what it cost: histograms of its visual tokens and of its device seconds (its encodes, and
  its share by positions of every step that ran it) and, with `--gpu-hourly-price`, of its cost in dollars.
- The engine's own counters (`LLMEngine.stats()`), read at scrape time from the engine thread's latest snapshot:
  KV blocks used and total, prefix- and encoder-cache hit rates, preemptions, requests running and waiting, the
  OOM count (admissions refused or preemptions for lack of KV), and the seconds the encoder and the LM were busy:
  `rate(nanomm_encoder_busy_seconds_total[1m])` is the encoder's utilisation, the LM's likewise.
- What a split engine moves (lesson 13): visual tokens this instance's tower encoded, visual-token bytes
  received from an encoder service, KV bytes sent to or received from a peer, requests parked for a decode peer.
- Every role's host CPU: `rate(nanomm_host_cpu_seconds_total[1m])`, the cores the process keeps busy.

Every metric lives in this object's own registry (no global state): two servers in one process do not mix.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanomm.outputs import RequestOutput

# Latency buckets at most 1.5x apart from 10 ms to 60 s, so that a p95 read from them is within that ratio
LATENCY_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 1.5,
                   2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)
VISUAL_TOKEN_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # 0: text only
DEVICE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_STAGES = ("preprocess", "queue", "encode", "prefill", "transfer")  # transfer: a decode instance's KV pull
# engine.stats() key -> (metric name, help, kind)
ENGINE_STATS = {
    "kv_blocks_used": ("nanomm_kv_blocks_used", "KV blocks holding a running request's tokens", "gauge"),
    "kv_blocks_total": ("nanomm_kv_blocks_total", "KV blocks in the pool", "gauge"),
    "kv_blocks_cached": ("nanomm_kv_blocks_cached", "free KV blocks that still hold a prefix-cache entry", "gauge"),
    "prefix_cache_hit_rate": ("nanomm_prefix_cache_hit_rate", "prompt tokens served from the prefix cache, "
                              "over the tokens looked up", "gauge"),
    "encoder_cache_hit_rate": ("nanomm_encoder_cache_hit_rate", "images served from the encoder cache", "gauge"),
    "running": ("nanomm_requests_running", "requests scheduled", "gauge"),
    "waiting": ("nanomm_requests_waiting", "requests waiting for a seat or KV blocks", "gauge"),
    "preprocess_queue": ("nanomm_requests_preprocessing", "requests whose images are being decoded", "gauge"),
    "preemptions": ("nanomm_preemptions", "requests preempted because the KV pool ran dry", "counter"),
    "kv_allocation_failures": ("nanomm_kv_allocation_failures", "the OOM count: admissions refused for lack of KV "
                               "blocks (once per wait), plus preemptions", "counter"),
    "encoder_busy_s": ("nanomm_encoder_busy_seconds", "seconds this instance's own vision tower encoded (its rate "
                       "is the encoder's utilisation)", "counter"),
    "lm_busy_s": ("nanomm_lm_busy_seconds", "seconds of engine steps that ran the language model, encodes "
                  "excluded (its rate is the LM's utilisation)", "counter"),
    "steps": ("nanomm_engine_steps", "engine steps", "counter"),
    "visual_tokens_encoded": ("nanomm_encoder_visual_tokens", "visual tokens this instance's own tower encoded "
                              "(0 with an encoder service)", "counter"),
    "processor_cache_decodes": ("nanomm_processor_cache_decodes", "pictures and videos decoded and preprocessed "
                                "(not served by the processor cache)", "counter"),
    "processor_cache_hits": ("nanomm_processor_cache_hits", "pictures and videos served by the processor cache, "
                             "by their bytes or a client's uuid", "counter"),
    "processor_cache_misses": ("nanomm_processor_cache_misses", "processor-cache lookups that found nothing",
                               "counter"),
    "processor_cache_bytes": ("nanomm_processor_cache_bytes", "pixel bytes the processor cache holds", "gauge"),
    "kv_requests_parked": ("nanomm_kv_requests_parked", "prefilled requests whose KV waits for a decode instance",
                           "gauge"),
}


class ServerMetrics:
    def __init__(self, gpu_hourly_price: float | None = None):
        """gpu_hourly_price: dollars per hour of the device (`--gpu-hourly-price`); with it, each request's cost is
        its device seconds at that price (`nanomm_request_cost_dollars`)."""
        if gpu_hourly_price is not None and not 0 < gpu_hourly_price < float("inf"):
            raise ValueError(f"gpu_hourly_price must be a number of dollars over 0, got {gpu_hourly_price!r}")
        self.registry = CollectorRegistry()
        self.latest_stats: dict = {}  # the engine thread replaces it after every step
        self.dollars_per_device_second = None if gpu_hourly_price is None else gpu_hourly_price / 3600

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.ttft = histogram("nanomm_time_to_first_token_seconds", "arrival -> first token")
        self.stages = {stage: histogram(f"nanomm_ttft_{stage}_seconds", f"the {stage} stage of TTFT")
                       for stage in TTFT_STAGES}
        self.tpot = histogram("nanomm_time_per_output_token_seconds", "mean time per output token after the first")
        self.e2e = histogram("nanomm_e2e_request_latency_seconds", "arrival -> finished")
        self.request_visual_tokens = histogram("nanomm_request_visual_tokens", "visual tokens in a request's prompt",
                                               VISUAL_TOKEN_BUCKETS)
        self.device_seconds = histogram("nanomm_request_device_seconds", "a request's device time: its encodes, and "
                                        "its share by positions of every step that ran it", DEVICE_SECONDS_BUCKETS)
        self.cost = None if self.dollars_per_device_second is None else histogram(
            "nanomm_request_cost_dollars", "a request's device seconds at --gpu-hourly-price",
            tuple(b * self.dollars_per_device_second for b in DEVICE_SECONDS_BUCKETS))
        self.prompt_tokens = Counter("nanomm_prompt_tokens", "prompt tokens, visual ones included",
                                     registry=self.registry)
        self.visual_tokens = Counter("nanomm_visual_tokens", "visual tokens in prompts", registry=self.registry)
        self.generation_tokens = Counter("nanomm_generation_tokens", "generated tokens", registry=self.registry)
        self.requests = Counter("nanomm_requests", "finished requests", ["finish_reason"], registry=self.registry)
        self.kv_transfer_bytes = Counter("nanomm_kv_transfer_bytes", "KV bytes moved between prefill and decode "
                                         "instances", ["direction"], registry=self.registry)
        for direction in ("sent", "received"):
            self.kv_transfer_bytes.labels(direction=direction)
        self.registry.register(_EngineStatsCollector(self))
        self.registry.register(HostCPUCollector())

    def record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
            for stage in TTFT_STAGES:
                self.stages[stage].observe(getattr(m, f"{stage}_s"))
        if m.tpot_s is not None:
            self.tpot.observe(m.tpot_s)
        if m.e2e_s is not None:
            self.e2e.observe(m.e2e_s)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.visual_tokens.inc(m.num_visual_tokens)
        self.request_visual_tokens.observe(m.num_visual_tokens)
        self.device_seconds.observe(m.device_s)
        if self.cost is not None:
            self.cost.observe(m.device_s * self.dollars_per_device_second)
        for completion in out.outputs:
            self.generation_tokens.inc(len(completion.token_ids))
            self.requests.labels(finish_reason=completion.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HostCPUCollector:
    """This process's CPU seconds, user and system, read at scrape time; every role registers one."""
    def collect(self):
        family = CounterMetricFamily("nanomm_host_cpu_seconds", "CPU seconds this process used, user and system")
        family.add_metric([], time.process_time())
        yield family


class _EngineStatsCollector:
    """Engine counters as Prometheus metrics, from the latest stats() snapshot (read at scrape time)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.latest_stats
        for key, (name, doc, kind) in ENGINE_STATS.items():
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc)
            family.add_metric([], float(stats.get(key, 0)))
            yield family
        visual = CounterMetricFamily("nanomm_visual_token_transfer_bytes", "visual-token bytes moved to or from an "
                                     "encoder service", labels=["direction"])
        visual.add_metric(["sent"], 0.0)  # an engine sends images; the encoder service sends the tokens
        visual.add_metric(["received"], float(stats.get("visual_token_bytes_received", 0)))
        yield visual

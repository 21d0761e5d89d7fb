"""`nanomm-top URL`: a live terminal view of one nanomm instance, or of a router and every instance of its pools.

    nanomm-top http://127.0.0.1:8000                # a frame every second, until Ctrl-C
    nanomm-top http://127.0.0.1:8000 --once         # one frame on stdout (two scrapes, --interval apart)
    nanomm-top --files                              # the Prometheus rules, their tests, the Grafana dashboard

Lesson: lessons/11-serving-under-load.md (the monitoring section: what each number means, and when to worry).

It reads what Prometheus reads, each instance's /metrics (serve/metrics.py), and shows per instance:

- load: requests running and waiting, KV blocks used of the pool (a bar), allocation failures (the OOM count),
  the encoder's and the LM's busy share, visual and output tokens per second, the prefix- and encoder-cache hit
  rates;
- requests: finished requests, the TTFT's p50 and p95 (estimated from the histogram's buckets, as Prometheus'
  histogram_quantile does), and the mean visual tokens, device seconds and cost of a request;
- TTFT stages: the mean of each stage (preprocess, queue, encode, prefill, KV transfer), each drawn as a bar of
  its share of the mean TTFT.

Rates are over the wall time between the last two scrapes. Quantiles and means are over the requests that
finished between them, or over every request since the server started when none did. A URL whose /metrics has
`nanomm_router_outstanding_work{role,url}` is a router: each instance it names is scraped too, one row each,
grouped by pool. A metric an instance does not export (an older server; an encoder service has no KV) is "-";
an instance that does not answer is an "unreachable: <why>" row, and the view keeps going.

Three pure steps, each testable on its own: `parse_metrics` (text -> Snapshot), `compute_view` (the last two
Scrapes -> View, the numbers) and `render` (View -> a rich renderable); `main` loops over them.
"""

import argparse
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.text import Text

from nanomm.serve.metrics import TTFT_STAGES

MONITORING = Path(__file__).parent / "monitoring"
MONITORING_FILES = ("rules.yml", "rules_test.yml", "dashboard.json", "prometheus.yml")
ROUTER_METRIC = "nanomm_router_outstanding_work"
POOL_ORDER = ("encoder", "prefill", "decode", "engine")
TTFT = "nanomm_time_to_first_token_seconds"
FRAME_WIDTH = 120  # --once into a pipe or a file: lines this long, not wrapped at 80

Labels = tuple[tuple[str, str], ...]


# -- 1. a scrape ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram: (upper bound, cumulative count) per bucket, +Inf last; its sum and count."""
    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def since(self, earlier: "Histogram") -> "Histogram":
        """What was observed after `earlier` (the same histogram, scraped before)."""
        before = dict(earlier.buckets)
        return Histogram(tuple((bound, count - before.get(bound, 0.0)) for bound, count in self.buckets),
                         self.sum - earlier.sum, self.count - earlier.count)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket that holds the rank; in the +Inf bucket, the
        largest finite bound."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in self.buckets:
            if count >= rank:
                if math.isinf(bound):
                    return lower_bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
            lower_bound, lower_count = bound, count
        return lower_bound


@dataclass(frozen=True)
class Snapshot:
    """One instance's /metrics at one moment (time.monotonic()), or why it could not be read (`error`)."""
    url: str
    taken_at: float
    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)  # sample name -> labels -> value
    families: frozenset[str] = frozenset()  # metric families named, even with no sample (a router's empty pools)
    role: str | None = None
    error: str | None = None

    def total(self, name: str) -> float | None:
        """The sum of a sample over its label sets (a counter by finish reason: all of them); None if absent."""
        values = self.samples.get(name)
        return sum(values.values()) if values else None

    def histogram(self, name: str) -> Histogram | None:
        buckets = self.samples.get(name + "_bucket")
        count, total = self.total(name + "_count"), self.total(name + "_sum")
        if not buckets or count is None or total is None:
            return None
        bounds = sorted((float(dict(labels)["le"]), value) for labels, value in buckets.items())
        return Histogram(tuple(bounds), total, count)

    @property
    def is_router(self) -> bool:
        return ROUTER_METRIC in self.families


def parse_metrics(url: str, text: str, taken_at: float, role: str | None = None) -> Snapshot:
    """A /metrics body (Prometheus' text format) as a Snapshot; ValueError if it is not that format."""
    samples: dict[str, dict[Labels, float]] = {}
    families = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return Snapshot(url.rstrip("/"), taken_at, samples, frozenset(families), role)


def router_instances(router: Snapshot) -> list[tuple[str, str, float]]:
    """(role, url, outstanding work) of each instance a router names, pool by pool (encoder, prefill, decode; or engine)."""
    seen, instances = set(), []
    for labels, work in router.samples.get(ROUTER_METRIC, {}).items():
        role, url = dict(labels).get("role", "?"), dict(labels).get("url", "")
        if url and url not in seen:
            seen.add(url)
            instances.append((role, url.rstrip("/"), work))
    rank = {role: i for i, role in enumerate(POOL_ORDER)}
    return sorted(instances, key=lambda entry: rank.get(entry[0], len(rank)))


@dataclass(frozen=True)
class Scrape:
    """One tick: the URL given, and the instances shown (that URL itself, or every instance of its pools)."""
    target: Snapshot
    instances: tuple[Snapshot, ...]


def scrape(client: httpx.Client, url: str, role: str | None = None) -> Snapshot:
    """An instance's /metrics, never an exception: a failure is a Snapshot with `error` set. The role, unless
    given (a router names it), is what the instance's /health says."""
    url = url.rstrip("/")
    try:
        answer = client.get(url + "/metrics")
        answer.raise_for_status()
        taken_at = time.monotonic()
        return parse_metrics(url, answer.text, taken_at, role or health_role(client, url))
    except httpx.HTTPStatusError as exc:
        return Snapshot(url, time.monotonic(), role=role, error=f"HTTP {exc.response.status_code} from /metrics")
    except httpx.HTTPError as exc:
        return Snapshot(url, time.monotonic(), role=role, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
    except ValueError as exc:
        return Snapshot(url, time.monotonic(), role=role, error=f"/metrics is not Prometheus' format ({exc})")


def health_role(client: httpx.Client, url: str) -> str:
    try:
        return str(client.get(url + "/health").json().get("role", "?"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return "?"


def scrape_target(client: httpx.Client, url: str) -> Scrape:
    """The URL's /metrics; if it is a router's, every instance it names too (at once, a thread each)."""
    target = scrape(client, url)
    if not target.is_router:
        return Scrape(target, (target,))
    named = router_instances(target)
    if not named:
        return Scrape(target, ())
    with ThreadPoolExecutor(max_workers=min(16, len(named))) as threads:
        instances = tuple(threads.map(lambda entry: scrape(client, entry[1], entry[0]), named))
    return Scrape(target, instances)


# -- 2. the numbers ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InstanceView:
    """What one row shows. None: not exported, or not measurable yet (a rate needs two scrapes)."""
    url: str
    role: str
    error: str | None = None
    running: float | None = None
    waiting: float | None = None
    kv_used: float | None = None
    kv_total: float | None = None
    allocation_failures: float | None = None
    encoder_busy: float | None = None  # a fraction of wall time
    lm_busy: float | None = None
    visual_tokens_per_s: float | None = None
    output_tokens_per_s: float | None = None
    prefix_hit_rate: float | None = None
    encoder_hit_rate: float | None = None
    finished: float | None = None
    outstanding_work: float | None = None  # a router's: what it has sent this instance and not had back
    window_s: float | None = None  # the quantiles' and means' window; None: every request since the start
    window_requests: float | None = None
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    ttft_mean: float | None = None
    mean_visual_tokens: float | None = None
    mean_device_s: float | None = None
    mean_cost: float | None = None
    stages: tuple[tuple[str, float | None], ...] = ()  # (stage, mean seconds per request)


@dataclass(frozen=True)
class View:
    url: str
    is_router: bool
    router: InstanceView | None  # the router's own row: requests routed, TTFT as its clients see it
    instances: tuple[InstanceView, ...]
    routed: tuple[tuple[str, float], ...] = ()  # a router's requests by outcome ("200", "502", ...)


def counter_rate(before: Snapshot | None, now: Snapshot, name: str) -> float | None:
    """Per second of wall time between the two scrapes; a counter that went down restarted, from zero."""
    if before is None or before.error or now.taken_at <= before.taken_at:
        return None
    earlier, later = before.total(name), now.total(name)
    if earlier is None or later is None:
        return None
    return (later - earlier if later >= earlier else later) / (now.taken_at - before.taken_at)


def first_rate(before: Snapshot | None, now: Snapshot, *names: str) -> float | None:
    """The rate of the first of these counters that the instance exports."""
    for name in names:
        if now.total(name) is not None:
            return counter_rate(before, now, name)
    return None


def request_window(before: Snapshot | None, now: Snapshot) -> Snapshot | None:
    """The scrape to subtract for per-request numbers: the previous one if requests finished since (a TTFT was
    observed), else None (every request since the start)."""
    if before is None or before.error:
        return None
    earlier, later = before.histogram(TTFT), now.histogram(TTFT)
    if earlier is None or later is None or later.count <= earlier.count:
        return None
    return before


def windowed(since: Snapshot | None, now: Snapshot, name: str) -> Histogram | None:
    histogram = now.histogram(name)
    earlier = since.histogram(name) if since is not None else None
    if histogram is None or earlier is None or histogram.count < earlier.count:
        return histogram
    return histogram.since(earlier)


def mean_of(since: Snapshot | None, now: Snapshot, name: str) -> float | None:
    histogram = windowed(since, now, name)
    return histogram.mean() if histogram is not None else None


def instance_view(before: Snapshot | None, now: Snapshot, outstanding_work: float | None = None) -> InstanceView:
    """One instance's numbers from its previous scrape (None: the first) and this one."""
    role = now.role or "?"
    if now.error:
        return InstanceView(now.url, role, error=now.error)
    since = request_window(before, now)
    ttft = windowed(since, now, TTFT)
    return InstanceView(
        now.url, role,
        running=now.total("nanomm_requests_running"), waiting=now.total("nanomm_requests_waiting"),
        kv_used=now.total("nanomm_kv_blocks_used"), kv_total=now.total("nanomm_kv_blocks_total"),
        allocation_failures=now.total("nanomm_kv_allocation_failures_total"),
        encoder_busy=counter_rate(before, now, "nanomm_encoder_busy_seconds_total"),
        lm_busy=counter_rate(before, now, "nanomm_lm_busy_seconds_total"),
        visual_tokens_per_s=first_rate(before, now, "nanomm_visual_tokens_total",
                                       "nanomm_encoder_visual_tokens_total"),  # an encoder service's
        output_tokens_per_s=counter_rate(before, now, "nanomm_generation_tokens_total"),
        prefix_hit_rate=now.total("nanomm_prefix_cache_hit_rate"),
        encoder_hit_rate=now.total("nanomm_encoder_cache_hit_rate"),
        finished=now.total("nanomm_requests_total"), outstanding_work=outstanding_work,
        window_s=now.taken_at - since.taken_at if since is not None else None,
        window_requests=ttft.count if ttft is not None else None,
        ttft_p50=ttft.quantile(0.5) if ttft is not None else None,
        ttft_p95=ttft.quantile(0.95) if ttft is not None else None,
        ttft_mean=ttft.mean() if ttft is not None else None,
        mean_visual_tokens=mean_of(since, now, "nanomm_request_visual_tokens"),
        mean_device_s=mean_of(since, now, "nanomm_request_device_seconds"),
        mean_cost=mean_of(since, now, "nanomm_request_cost_dollars"),
        stages=tuple((stage, mean_of(since, now, f"nanomm_ttft_{stage}_seconds")) for stage in TTFT_STAGES))


def router_view(before: Snapshot | None, now: Snapshot) -> InstanceView:
    """The router's own row: requests routed (every outcome) and the TTFT its clients saw."""
    row = instance_view(before, now)
    if row.error:
        return InstanceView(now.url, "router", error=row.error)
    return InstanceView(now.url, "router", finished=now.total("nanomm_router_requests_total"),
                        window_s=row.window_s, window_requests=row.window_requests, ttft_p50=row.ttft_p50,
                        ttft_p95=row.ttft_p95, ttft_mean=row.ttft_mean)


def compute_view(previous: Scrape | None, current: Scrape) -> View:
    """The numbers of a frame, from the last two scrapes (previous: None on the first)."""
    earlier = {s.url: s for s in (previous.target, *previous.instances)} if previous else {}
    target = current.target
    work = {url: w for _, url, w in router_instances(target)}
    instances = tuple(instance_view(earlier.get(s.url), s, work.get(s.url)) for s in current.instances)
    if not target.is_router:
        return View(target.url, False, None, instances)
    routed = tuple((dict(labels).get("outcome", "?"), value) for labels, value
                   in target.samples.get("nanomm_router_requests_total", {}).items())
    return View(target.url, True, router_view(earlier.get(target.url), target), instances, routed)


# -- 3. the frame -----------------------------------------------------------------------------------------------

EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(fraction: float, width: int) -> str:
    """A bar `width` characters long, filled to `fraction` (clamped to 0..1) in eighths of a character, the rest
    dotted: always one word."""
    eighths = round(min(max(fraction, 0.0), 1.0) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (EIGHTHS[part] if part else "")).ljust(width, "·")


def number(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def per_second(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x < 10_000 else f"{x / 1000:.1f}k"


def seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f}ms" if x < 1 else f"{x:.2f}s"


def dollars(x: float | None) -> str:
    return "-" if x is None else f"${x:.3g}"


@dataclass(frozen=True)
class Column:
    title: str
    width: int
    align: str = ">"  # f-string alignment: ">" numbers, "<" words


def cell(text: str, column: Column) -> str:
    if len(text) > column.width:
        text = text[:column.width - 1] + "…"
    return f"{text:{column.align}{column.width}}"


def line(columns: list[Column], cells: list, style: str = "") -> Text:
    """One row: each cell (a str, or (str, style)) padded or cut to its column, one space apart."""
    row = Text(style=style, no_wrap=True, overflow="ellipsis")
    for i, (column, value) in enumerate(zip(columns, cells)):
        text, cell_style = value if isinstance(value, tuple) else (value, "")
        row.append((" " if i else "") + cell(text, column), cell_style)
    return row


def identity_columns(rows: list[InstanceView]) -> list[Column]:
    role = max([4, *(len(r.role) for r in rows)])
    host = max([8, *(len(short(r.url)) for r in rows)])
    return [Column("role", role, "<"), Column("instance", host, "<")]


def short(url: str) -> str:
    return url.split("://", 1)[-1]


def unreachable(columns: list[Column], row: InstanceView) -> Text:
    """The row of an instance that did not answer: why, across the row (wrapped, never cut)."""
    text = line(columns, [row.role, short(row.url)]).append(f" unreachable: {row.error}", "bold red")
    text.no_wrap, text.overflow = False, "fold"
    return text


LOAD_COLUMNS = [Column("run", 4), Column("wait", 5), Column("KV blocks", 21, "<"), Column("oom", 4),
                Column("enc busy", 8), Column("LM busy", 7), Column("vis tok/s", 9), Column("out tok/s", 9),
                Column("pfx hit", 7), Column("enc hit", 7)]
KV_BAR = 6


def kv_cell(row: InstanceView) -> tuple[str, str]:
    if row.kv_used is None or row.kv_total is None:
        return "-", ""
    fraction = row.kv_used / row.kv_total if row.kv_total else 0.0
    style = "red" if fraction > 0.9 else "yellow" if fraction > 0.7 else "green"
    return f"{bar(fraction, KV_BAR)} {row.kv_used:.0f}/{row.kv_total:.0f}", style


def load_block(rows: list[InstanceView]) -> list[Text]:
    columns = identity_columns(rows) + LOAD_COLUMNS
    lines = [Text("load", style="bold"), line(columns, [c.title for c in columns], "bold dim")]
    for row in rows:
        if row.error:
            lines.append(unreachable(columns, row))
            continue
        failures = (number(row.allocation_failures), "bold red" if row.allocation_failures else "")
        lines.append(line(columns, [
            row.role, short(row.url), number(row.running), number(row.waiting), kv_cell(row), failures,
            percent(row.encoder_busy), percent(row.lm_busy), per_second(row.visual_tokens_per_s),
            per_second(row.output_tokens_per_s), percent(row.prefix_hit_rate), percent(row.encoder_hit_rate)]))
    return lines


REQUEST_COLUMNS = [Column("done", 6), Column("work", 6), Column("window", 9), Column("n", 5),
                   Column("TTFT p50", 9), Column("TTFT p95", 9), Column("vis tok/req", 11),
                   Column("device/req", 10), Column("$/req", 9)]


def window_cell(row: InstanceView) -> str:
    """The seconds since the previous scrape, or "all": every request since the start."""
    return "all" if row.window_s is None else f"{row.window_s:.1f}s"


def requests_block(rows: list[InstanceView]) -> list[Text]:
    columns = identity_columns(rows) + REQUEST_COLUMNS
    lines = [Text("requests (TTFT and means: over the window's requests)", style="bold"),
             line(columns, [c.title for c in columns], "bold dim")]
    for row in rows:
        lines.append(line(columns, [
            row.role, short(row.url), number(row.finished), number(row.outstanding_work), window_cell(row),
            number(row.window_requests),
            seconds(row.ttft_p50), seconds(row.ttft_p95), number(row.mean_visual_tokens, 1),
            seconds(row.mean_device_s), dollars(row.mean_cost)]))
    return lines


STAGE_BAR = 7
STAGE_COLUMNS = [Column("mean TTFT", 9)] + [Column(stage, STAGE_BAR + 8, "<") for stage in TTFT_STAGES]


def stage_cell(mean_s: float | None, ttft_mean: float | None) -> str:
    """The stage's bar (its share of the mean TTFT) and its mean."""
    if mean_s is None or not ttft_mean:
        return "-"
    return f"{bar(mean_s / ttft_mean, STAGE_BAR)} {seconds(mean_s)}"


def stages_block(rows: list[InstanceView]) -> list[Text]:
    columns = identity_columns(rows) + STAGE_COLUMNS
    lines = [Text("TTFT stages (mean per request; bar: the share of the mean TTFT)", style="bold"),
             line(columns, [c.title for c in columns], "bold dim")]
    for row in rows:
        lines.append(line(columns, [row.role, short(row.url), seconds(row.ttft_mean),
                                    *(stage_cell(mean, row.ttft_mean) for _, mean in row.stages)]))
    return lines


def header(view: View) -> Text:
    down = sum(1 for row in view.instances if row.error)
    text = Text("nanomm-top ", style="bold")
    if not view.is_router:
        return text.append(view.url)
    text.append(f"router {view.url}: {len(view.instances)} instances")
    if down:
        text.append(f", {down} unreachable", style="bold red")
    if view.routed:
        text.append("; routed " + ", ".join(f"{outcome} x{count:.0f}" for outcome, count in view.routed))
    return text


def render(view: View) -> Group:
    """The frame: a header, then the load, requests and TTFT-stage blocks, one row per instance (pool by pool
    under a router; the router's own row with the requests). An unreachable instance is one row, in the load
    block."""
    if not view.instances:
        return Group(header(view), Text("(the router names no instance)", style="dim"))
    answering = [row for row in view.instances if not row.error]
    blocks = [load_block(list(view.instances))]
    if answering or view.router:
        blocks.append(requests_block(([view.router] if view.router else []) + answering))
    if answering:
        blocks.append(stages_block(answering))
    return Group(header(view), *(piece for block in blocks for piece in [Text(""), *block]))


# -- the command ------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanomm-top", description="A live view of a nanomm instance, or of a "
                                "router and its pools, from their /metrics.")
    p.add_argument("url", nargs="?", help="an instance's or a router's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes (default 1)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds an instance may take to answer a scrape")
    p.add_argument("--once", action="store_true", help="print one frame (two scrapes, --interval apart) and exit")
    p.add_argument("--files", action="store_true", help="print the paths of the shipped monitoring files "
                   "(Prometheus rules, their tests, its scrape config, the Grafana dashboard) and exit")
    args = p.parse_args(argv)
    if not args.files and not args.url:
        p.error("give the URL of an instance or a router (or --files)")
    if args.interval <= 0:
        p.error("--interval must be more than 0 seconds")
    return args


def print_files() -> int:
    """The monitoring files' paths, one a line; 1 if any is missing (named on stderr)."""
    missing = [name for name in MONITORING_FILES if not (MONITORING / name).is_file()]
    for name in MONITORING_FILES:
        print(MONITORING / name)
    if missing:
        print(f"nanomm-top: missing from the package: {', '.join(missing)}", file=sys.stderr)
    return 1 if missing else 0


def watch(client: httpx.Client, url: str, interval: float, console: Console) -> None:
    """A frame every `interval` seconds, until Ctrl-C."""
    from rich.live import Live

    previous = None
    with Live(Text("scraping " + url), console=console, auto_refresh=False) as live:
        while True:
            started = time.monotonic()
            current = scrape_target(client, url)
            live.update(render(compute_view(previous, current)), refresh=True)
            previous = current
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.files:
        return print_files()
    console = Console()
    if not console.is_terminal:
        console = Console(width=FRAME_WIDTH)
    with httpx.Client(timeout=args.timeout) as client:
        if args.once:
            first = scrape_target(client, args.url)
            time.sleep(args.interval)
            console.print(render(compute_view(first, scrape_target(client, args.url))))
            return 0
        try:
            watch(client, args.url, args.interval, console)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

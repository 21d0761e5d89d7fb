"""nanomm-serve: the engine behind an OpenAI-compatible HTTP server (an optional extra: `pip install -e ".[serve]"`).

Nothing on the request path imports this package; it is a front end, like the chat CLI. In reading order:

- `protocol.py`: OpenAI's JSON in (messages, image_url parts, sampling fields) -> a prompt and `SamplingParams`;
  `RequestOutput` -> OpenAI's JSON out (whole responses and streamed chunks), and OpenAI's error shape.
- `engine_loop.py`: one thread owns the engine and steps it; HTTP handlers talk to it through queues.
- `metrics.py`: Prometheus metrics (TTFT and its stages, tokens, KV blocks, cache hit rates, encoder and LM busy
  seconds, the OOM count, each request's visual tokens, device seconds and cost); `monitoring/` beside it holds
  Prometheus rules and their tests, a scrape config and a Grafana dashboard.
- `app.py`: one engine instance's Starlette routes (and the prefill and decode roles); `cli.py`: the `nanomm-serve`
  command and `build_server`, each role's server; `testing.py`: a server on a background thread, for tests.
- `top.py`: `nanomm-top`, a live terminal view of an instance's or a router's pools' /metrics.
- the split engine's `encoder_server.py` and `router.py`, and Ray Serve's `ray.py` and `autoscaling.py` (lessons 13, 15).
"""

"""The `nanomm-serve` command: its options, and the one place a role becomes a server.

    nanomm-serve --demo                                   # the trained offline demo model on 127.0.0.1:8000
    nanomm-serve Qwen/Qwen2-VL-2B-Instruct --port 8000    # a real model (cuda + bfloat16 when available)
    nanomm-serve --demo --role encoder --port 8001        # one part of a split engine (lesson 13)

Lessons: lessons/11-serving-under-load.md (one integrated server under load) and lessons/13-three-topologies.md
(`--role encoder|prefill|decode|router`). `build_server(role, spec)` makes the server of each role, for this
command and for Ray Serve's replicas (ray.py, lesson 15) alike; the routes themselves are app.py's (an engine
instance), encoder_server.py's and router.py's.
"""

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

ROLES = ["integrated", "encoder", "prefill", "decode", "router"]


@dataclass
class InstanceSpec:
    """What build_server needs to make one instance: from this command's options, or from a Ray replica's spec."""
    name: str | None  # the model's name in the API (the router names none)
    model: str | None = None  # a checkpoint folder or hub id; None for the router, or with engine_args["emulate"]
    engine_args: dict = field(default_factory=dict)  # LLM's keyword arguments (emulate, device, dtype, max_pixels ...)
    encoder_urls: tuple[str, ...] = ()  # the router's encoder pool; the encoders a prefill instance's requests may name
    prefill_urls: tuple[str, ...] = ()  # the router's pools
    decode_urls: tuple[str, ...] = ()
    peer_timeout_s: float = 30.0  # the router's, and a decode instance's KV pull
    max_body_bytes: int = 32 * 2**20
    server_options: dict = field(default_factory=dict)  # more of ServerConfig (max_pending_requests, media_root ...)
    engine_urls: tuple[str, ...] = ()  # the router's pool of engines that take whole requests (dp<N>, <X>e<Y>pd)
    routing: str = "load"  # the router's pick among engines or prefill instances (serve/affinity.py)
    affinity_slack: float = 8192.0  # work an affine pick may hold beyond the least loaded instance's


def build_server(role: str, spec: InstanceSpec):
    """The server of `nanomm-serve --role ROLE`: an object whose `app` is the ASGI application to serve (a Router,
    an EncoderServer, or an engine's Server, which owns an LLM to close when serving ends)."""
    if role == "router":
        from nanomm.serve.router import Router

        return Router(list(spec.encoder_urls), list(spec.prefill_urls), list(spec.decode_urls), spec.peer_timeout_s,
                      spec.max_body_bytes, engine_urls=list(spec.engine_urls), routing=spec.routing,
                      affinity_slack=spec.affinity_slack)
    if role == "encoder":
        from nanomm.serve.encoder_server import EncoderServer

        return EncoderServer(_encoder_service(spec), spec.name)
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; the roles are {ROLES}")
    from nanomm import LLM
    from nanomm.serve.app import Server, ServerConfig

    config = ServerConfig(spec.name, role=role, encoder_urls=spec.encoder_urls, kv_pull_timeout_s=spec.peer_timeout_s,
                          max_body_bytes=spec.max_body_bytes, **spec.server_options)
    return Server(LLM(spec.model, **spec.engine_args), config)


def _encoder_service(spec: InstanceSpec):
    """The vision tower an encoder instance serves: the model's, or the emulated device's."""
    from nanomm.serve.encoder_server import load_emulated_encoder, load_encoder

    args = spec.engine_args
    if args.get("emulate"):
        return load_emulated_encoder(args["emulate"], args.get("max_pixels"), args.get("emulate_cost_file"),
                                     max_num_encoder_tokens=args.get("max_num_encoder_tokens"))
    return load_encoder(spec.model, args.get("device"), args.get("dtype"), args.get("max_pixels"),
                        args.get("max_num_encoder_tokens"))


# -- the command ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="nanomm-serve", description="An OpenAI-compatible server for Qwen2-VL.")
    p.add_argument("model", nargs="?", help="a checkpoint folder or hub id (default: --demo; none for the router)")
    p.add_argument("--role", default="integrated", choices=ROLES,
                   help="what this instance does in a split engine (default: everything, one engine)")
    p.add_argument("--encoder-url", action="append", default=[], metavar="URL",
                   help="an encoder service: the engine runs no vision tower (repeatable: the router picks one "
                        "per request, the first is this engine's default)")
    p.add_argument("--prefill-url", action="append", default=[], metavar="URL", help="router: a prefill instance")
    p.add_argument("--decode-url", action="append", default=[], metavar="URL", help="router: a decode instance")
    p.add_argument("--engine-url", action="append", default=[], metavar="URL",
                   help="router: an engine that takes whole requests, integrated or with its own --encoder-url "
                        "(dp<N>, <X>e<Y>pd; instead of --prefill-url and --decode-url)")
    p.add_argument("--routing", choices=["affinity", "load"], default="load",
                   help="router: how a request picks among engines (or prefill instances): 'affinity' sends it "
                        "where its prefix and pictures went before, within --affinity-slack of the least loaded; "
                        "'load' (the default) to the least loaded alone")
    p.add_argument("--affinity-slack", type=float, default=8192.0, metavar="TOKENS",
                   help="router: the outstanding work (prompt tokens for engines, visual tokens for prefill "
                        "instances) an affine pick may hold beyond the least loaded instance's (default 8192: "
                        "a few chat histories, serve/affinity.py)")
    p.add_argument("--peer-timeout", type=float, default=30.0,
                   help="seconds a peer may stay silent (a KV pull, an encode, a stream) before it is an error")
    p.add_argument("--kv-handoff-timeout", type=float, default=30.0,
                   help="prefill: seconds a parked request's KV waits for its decode instance before it is freed")
    p.add_argument("--demo", nargs="?", const="trained", choices=["trained", "random"],
                   help="the offline demo model: the trained one shipped with nanomm, or 'random' (made on first use)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model's name in the API (default: the model argument)")
    p.add_argument("--device"), p.add_argument("--dtype")
    p.add_argument("--max-model-len", type=int), p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-pixels", type=int, help="the engine's pixel cap per image")
    p.add_argument("--mm-processor-cache-gb", type=float, default=4.0, metavar="GIB",
                   help="preprocessed pictures and videos kept, so that one sent again (by its bytes or a content "
                        "part's uuid) is not decoded again; 0: none (vLLM's name)")
    p.add_argument("--max-num-encoder-tokens", type=int, metavar="TOKENS",
                   help="visual tokens one vision forward encodes at most, a larger picture alone: an engine's "
                        "per step (default: its token budget), an encoder's per batch of concurrent requests' "
                        "pictures (default 2048)")
    p.add_argument("--generation-config", default="auto", help="'auto', 'vllm' or a folder (as in vLLM)")
    p.add_argument("--max-pending-requests", type=int, default=256, help="in flight before a 503")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    p.add_argument("--max-body-mib", type=float, default=32.0, help="larger request bodies get a 413")
    p.add_argument("--allowed-local-media-path", type=Path,
                   help="a folder whose image files requests may name (default: data URLs only)")
    p.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                   help="hosts whose http(s) image and video URLs requests may name, fetched by the server "
                        "('*.example.com': its subdomains; default: none, every URL is a 400)")
    p.add_argument("--media-url-allow-redirects", action="store_true",
                   help="follow a media URL's redirects (each hop's host must be listed too)")
    p.add_argument("--allow-private-media-addresses", action="store_true",
                   help="let a listed host resolve to a loopback or private address (never a cloud metadata one)")
    p.add_argument("--media-fetch-timeout", type=float, nargs=2, default=(5.0, 30.0), metavar=("IMAGE_S", "VIDEO_S"),
                   help="seconds a fetch of an image and of a video may take, redirects included (default 5 30)")
    p.add_argument("--emulate", type=_emulate_value, metavar="GPU:MODEL",
                   help="serve on an emulated device, no weights: e.g. h200:qwen2-vl-2b (nanomm/emulate; every "
                        "role: the router, which runs no model, takes it and changes nothing)")
    p.add_argument("--emulate-cost-file", metavar="JSON", help="with --emulate: GPU figures measured on a real GPU")
    p.add_argument("--gpu-hourly-price", type=_price, metavar="DOLLARS",
                   help="the device's price per hour: /metrics then has each request's cost (nanomm_request_cost_dollars)")
    p.add_argument("--old-image-policy", help="long chats: what becomes of pictures older than the last "
                   "--keep-last-images: keep (default), drop, downscale:MAX_PIXELS or compress:METHOD:RATIO")
    p.add_argument("--keep-last-images", type=int, help="long chats: the last pictures of a prompt that stay whole")
    p.add_argument("--media-io-kwargs", type=_json_object, metavar="JSON",
                   help='how videos are sampled and capped, as in vLLM: \'{"video": {"num_frames": 32}}\' (keys: fps, '
                        "num_frames, min_frames, max_frames, do_sample_frames, video_min_pixels, video_max_pixels; "
                        "an fps or num_frames here samples every clip)")
    p.add_argument("--video-pruning-rate", type=float, default=0.0,
                   help="drop this share of each later temporal patch's least-changed tokens (EVS, lesson 17)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level ('info' logs every request)")
    return p.parse_args(argv)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    return value


def _price(text: str) -> float:
    try:
        price = float(text)
    except ValueError:
        price = -1.0
    if not 0 < price < float("inf"):  # NaN too; 0 would make every cost bucket the same
        raise argparse.ArgumentTypeError(f"{text!r}: a price is a number of dollars per hour, more than 0")
    return price


def _emulate_value(text: str) -> str:
    from nanomm.emulate import parse_emulate  # only when --emulate is given

    try:
        parse_emulate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def main(argv=None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(stderr=True)
    _refuse_a_model_where_none_loads(args)
    server = build_server(args.role, instance_spec(args, console))
    console.print(_what_is_served(args, server))
    uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level)
    llm = getattr(server, "llm", None)  # an engine instance's; the router and the encoder service have none
    if llm is not None:
        llm.close()
    return 0


def _refuse_a_model_where_none_loads(args) -> None:
    if args.emulate and (args.model or args.demo or args.device or args.dtype):
        raise SystemExit("nanomm-serve --emulate loads no model: drop the model, --demo, --device and --dtype")
    if args.role == "router" and (args.model or args.demo):
        raise SystemExit("nanomm-serve --role router loads no model: give it --prefill-url and --decode-url, "
                         "or --engine-url")
    if args.engine_url and args.role != "router":
        raise SystemExit("--engine-url is the router's: an engine takes --encoder-url")
    if args.role == "router" and args.engine_url and (args.prefill_url or args.decode_url or args.encoder_url):
        raise SystemExit("nanomm-serve --role router: --engine-url (whole requests, each engine with its own "
                         "--encoder-url) or --prefill-url and --decode-url (a split engine), not both")


def instance_spec(args, console) -> InstanceSpec:
    """The command's options as build_server takes them (the demo model found, or made, here)."""
    if args.role == "router":
        model, name = None, args.served_model_name
    elif args.emulate:
        model, name = None, args.served_model_name or args.emulate
    else:
        model, name = _model_and_name(args, console)
    server_options = {"max_pending_requests": args.max_pending_requests, "request_timeout_s": args.request_timeout,
                      "media_root": args.allowed_local_media_path, "media_urls": media_url_policy(args),
                      "gpu_hourly_price": args.gpu_hourly_price}
    return InstanceSpec(name, model, engine_args(args), tuple(args.encoder_url), tuple(args.prefill_url),
                        tuple(args.decode_url), args.peer_timeout, int(args.max_body_mib * 2**20), server_options,
                        tuple(args.engine_url), args.routing, args.affinity_slack)


def media_url_policy(args):
    """The http(s) media URLs requests may name (None: no --allowed-media-domains, every URL is refused)."""
    if not args.allowed_media_domains:
        return None
    from nanomm.inputs.media_fetch import MediaUrlPolicy

    image_s, video_s = args.media_fetch_timeout
    try:
        return MediaUrlPolicy(tuple(args.allowed_media_domains), args.media_url_allow_redirects,
                              args.allow_private_media_addresses, image_s, video_s)
    except ValueError as exc:
        raise SystemExit(f"nanomm-serve: {exc}") from None


def engine_args(args) -> dict:
    """The command's options that are LLM's arguments (an engine instance's; the encoder reads its share)."""
    return dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_pixels=args.max_pixels,
                mm_processor_cache_gb=args.mm_processor_cache_gb,
                max_num_encoder_tokens=args.max_num_encoder_tokens, generation_config=args.generation_config,
                encoder_url=args.encoder_url[0] if args.encoder_url else None, encoder_timeout_s=args.peer_timeout,
                kv_handoff_timeout_s=args.kv_handoff_timeout, emulate=args.emulate,
                emulate_cost_file=args.emulate_cost_file, media_io_kwargs=args.media_io_kwargs,
                video_pruning_rate=args.video_pruning_rate, **_long_chat_args(args))


def _long_chat_args(args) -> dict:
    """--old-image-policy and --keep-last-images, as engine arguments (those given; the engine checks them)."""
    given = {"old_image_policy": args.old_image_policy, "keep_last_images": args.keep_last_images}
    return {name: value for name, value in given.items() if value is not None}


def _model_and_name(args, console) -> tuple[str, str]:
    """The checkpoint folder (or hub id) to load, and the name the API gives it."""
    from nanomm.demo import demo_folder

    demo = args.demo or ("trained" if args.model is None else None)
    model = str(demo_folder(demo, console)) if demo else args.model
    return model, args.served_model_name or ("nanomm-demo" if demo else args.model)


def _what_is_served(args, server) -> str:
    where = f"http://{args.host}:{args.port}"
    if args.role == "router" and args.engine_url:
        return f"routing on {where}: whole requests to the engines {args.engine_url}"
    if args.role == "router":
        return (f"routing on {where}: prefill {args.prefill_url}, decode {args.decode_url}, "
                f"encoders {args.encoder_url or '(the prefill instances own)'}")
    if args.role == "encoder":
        return f"encoding for {server.model_name} on {where} (POST /v1/encode)"
    return f"serving {server.config.model_name} on {where} (OpenAI API under /v1, role {args.role})"


if __name__ == "__main__":  # python -m nanomm.serve.cli: what `nanomm-bench load` starts
    sys.exit(main())

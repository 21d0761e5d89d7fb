"""nanomm-chat: a multi-turn chat with a Qwen2-VL model about your images, in one file.

    nanomm-chat --demo --image shapes.png               # offline: the trained demo model (pictures of shapes)
    nanomm-chat --demo random                           # offline: a tiny random-weight model, made on first use
    nanomm-chat --model Qwen/Qwen2-VL-2B-Instruct --image cat.png
    nanomm-chat --demo --speculative ngram              # speculative decoding: prompt lookup (or a draft folder)
    nanomm-chat --demo --trace run.json                 # a timeline of every step, for ui.perfetto.dev
    echo "Describe it" | nanomm-chat --demo --image cat.png   # scriptable: one user turn per line
    nanomm-chat --demo --video clip.gif                 # a video: frames of a GIF, WebP or APNG (lesson 17)

Text lines are user turns; /image PATH and /video PATH attach to the next turn; /reset, /stats, /help, /quit.
Replies stream token by token, and a one-line summary follows each: time to first token split into
preprocess / encode (or "cached") / prefill, tokens per second, visual tokens, prefix-cached tokens. Ask a
second question about the same picture and watch the encoder and prefix caches make it cheaper
(lessons/07-encoder-cache.md explains the numbers).

It is a thin layer over `nanomm.LLM`: the chat template, the streaming `engine.add_request` / `engine.step`
loop, and the request metrics are all the library's.
"""

import argparse
import sys
import traceback

from rich.console import Console

DEFAULT_MODEL = "Qwen/Qwen2-VL-2B-Instruct"
HELP = """commands:
  /image PATH   attach an image to your next message (repeatable)
  /video PATH   attach a video (an animated GIF, WebP or APNG) to your next message
  /reset        forget the conversation
  /stats        engine counters (KV blocks, cache hit rates, tokens/s)
  /help         this text
  /quit         leave (Ctrl-D works too)"""


def load_llm(args, console: Console):
    """The LLM the user asked for; the demo model when asked, or when there is no --model and no network."""
    from nanomm import LLM
    from nanomm.demo import demo_folder
    from nanomm.errors import CheckpointError

    kwargs = dict(device=args.device, dtype=args.dtype, max_pixels=args.max_pixels, trace_path=args.trace,
                  speculative=speculative_config(args.speculative, args.num_speculative_tokens),
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                  visual_token_compression=args.compression)
    model = args.model
    if args.demo:
        model = str(demo_folder(args.demo, console))
    try:
        with console.status(f"loading {model or DEFAULT_MODEL} ..."):
            return LLM(model or DEFAULT_MODEL, **kwargs), args.demo
    except CheckpointError as exc:
        if model is not None or "cannot download" not in str(exc):
            raise
        console.print(f"[yellow]could not reach the Hugging Face hub for {DEFAULT_MODEL}; "
                      "starting the offline demo model instead (--demo)[/yellow]")
        folder = demo_folder("trained", console)
        with console.status(f"loading {folder} ..."):
            return LLM(str(folder), **kwargs), "trained"


def speculative_config(choice: str | None, k: int) -> dict | None:
    """--speculative ngram -> prompt lookup; --speculative DRAFT (a folder or hub id) -> that draft model."""
    if choice is None:
        return None
    if choice == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    return {"method": "draft", "model": choice, "num_speculative_tokens": k}


class Chat:
    """The conversation so far, and one turn at a time through the engine's streaming API."""

    def __init__(self, llm, params, console: Console, interactive: bool):
        self.llm, self.params, self.console, self.interactive = llm, params, console, interactive
        self.messages: list[dict] = []
        self.pending: list[dict] = []  # the image and video parts of the next message

    def attach(self, path: str) -> None:
        from nanomm.inputs.image_io import load_image

        load_image(path, name=path)  # fail now, with a clear sentence, not after the user typed a question
        self.pending.append({"type": "image", "image": path})
        self.say(f"attached {path} to your next message")

    def attach_video(self, path: str) -> None:
        from nanomm.inputs.video_io import load_video  # only when a video is attached

        frames = len(load_video(path, path).frames)  # fail now, as attach does
        self.pending.append({"type": "video", "video": path})
        self.say(f"attached {path} ({frames} frames) to your next message")

    def turn(self, text: str) -> None:
        content = self.pending + [{"type": "text", "text": text}]
        messages = self.messages + [{"role": "user", "content": content}]
        from nanomm.inputs.tokenizer import multi_modal_data

        prompt_text, media = self.llm.tokenizer.apply_chat_template(messages)
        prompt = {"prompt": prompt_text, "multi_modal_data": multi_modal_data(media)} if media else prompt_text
        final = self._stream(self.llm.engine.add_request(prompt, self.params))
        completion = final.outputs[0]
        if completion.finish_reason == "error":
            self.say(f"[red]error: {completion.error}[/red]")
            return
        self.messages = messages + [{"role": "assistant", "content": completion.text}]
        self.pending = []
        if self.interactive:
            self.console.print(f"[dim]{summary(final)}[/dim]")

    def _stream(self, request_id: str):
        engine, final = self.llm.engine, None
        if self.interactive:
            self.console.print("[bold green]assistant>[/bold green] ", end="")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    if self.interactive:
                        self.console.print(out.outputs[0].delta_text, end="", markup=False, highlight=False)
                    final = out if out.finished else final
        if self.interactive:
            self.console.print()
        else:
            print(" ".join(final.outputs[0].text.splitlines()), flush=True)  # one reply, one line
        return final

    def reset(self) -> None:
        self.messages, self.pending = [], []
        self.say("conversation reset")

    def stats(self) -> None:
        for key, value in self.llm.stats().items():
            self.say(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")

    def say(self, text: str) -> None:
        self.console.print(text, highlight=self.interactive)  # no colour guesses in logs


def summary(out) -> str:
    """TTFT split into preprocess / encode (or cached) / prefill, tokens/s, visual and prefix-cached tokens."""
    m = out.metrics
    ms = lambda s: f"{1000 * s:.0f} ms"  # noqa: E731
    encode = "cached" if m.num_visual_tokens and m.encode_s == 0 else ms(m.encode_s)
    decode_tps = 1 / m.tpot_s if m.tpot_s else 0.0
    visual = f"{m.num_visual_tokens} visual tokens"
    if m.num_encoded_visual_tokens > m.num_visual_tokens:  # compressed (lessons/10-visual-token-compression.md)
        visual += f" (of {m.num_encoded_visual_tokens} encoded)"
    line = (f"TTFT {ms(m.ttft_s)} (preprocess {ms(m.preprocess_s)}, encode {encode}, prefill {ms(m.prefill_s)}) | "
            f"{decode_tps:.1f} tok/s | {visual} | {m.num_cached_tokens} prefix-cached tokens")
    if m.num_draft_tokens:  # speculative decoding (lessons/08-speculative-decoding.md)
        line += f" | {m.acceptance_rate:.0%} of proposals accepted, {m.mean_tokens_per_decode_step:.2f} tokens/step"
    return line


def run(chat: Chat, lines) -> None:
    """One line at a time: a command, or a user turn. An error in one turn never ends the chat."""
    from nanomm.errors import InvalidInputError

    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        command, _, rest = line.partition(" ")
        try:
            if command == "/quit":
                return
            elif command == "/help":
                chat.say(HELP)
            elif command == "/reset":
                chat.reset()
            elif command == "/stats":
                chat.stats()
            elif command == "/image":
                chat.attach(rest.strip())
            elif command == "/video":
                chat.attach_video(rest.strip())
            elif line.startswith("/"):
                chat.say(f"unknown command {command}; /help lists them")
            else:
                chat.turn(line)
        except InvalidInputError as exc:
            chat.say(f"[red]{exc}[/red]")


def interactive_lines(console: Console):
    while True:
        try:
            yield console.input("[bold blue]you>[/bold blue] ")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="nanomm-chat", description="Chat with a Qwen2-VL model about your images.")
    p.add_argument("--model", help=f"local checkpoint folder or hub id (default: {DEFAULT_MODEL})")
    p.add_argument("--demo", nargs="?", const="trained", choices=["trained", "random"],
                   help="offline: the trained demo model shipped with nanomm (pictures of shapes), "
                        "or 'random', a tiny random-weight model made locally")
    p.add_argument("--image", action="append", default=[], metavar="PATH", help="attach to the first turn")
    p.add_argument("--video", action="append", default=[], metavar="PATH",
                   help="attach a video (animated GIF, WebP or APNG) to the first turn")
    p.add_argument("--max-pixels", type=int, help="the dynamic-resolution cap (visual tokens ~ pixels / 784)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--speculative", metavar="ngram|DRAFT",
                   help="speculative decoding: 'ngram' (prompt lookup) or a draft model's folder or hub id")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="proposals per step (default 4)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bf16 on cuda, f32 on cpu")
    p.add_argument("--quantization", choices=["int8", "int4"], help="weight-only, at load (lesson 09)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: a KV cache of 1 byte "
                   "per value (lesson 09)")
    p.add_argument("--compression", type=_compression, metavar="METHOD:RATIO", help="keep fewer visual tokens: "
                   "pool, random, prune or attention, e.g. prune:0.5 (lesson 10)")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto timeline of every engine step to FILE "
                   "on exit (open it in ui.perfetto.dev)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p.parse_args(argv)


def _compression(text: str) -> dict:
    from nanomm.inputs.compression import policy_argument  # nanomm is imported late here, after the arguments
    return policy_argument(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    interactive = sys.stdin.isatty()
    # Replies go to stdout; in a pipe everything else goes to stderr, so stdout is just the replies.
    console = Console() if interactive else Console(stderr=True, soft_wrap=True)  # logs: never wrap a line
    try:
        from nanomm import InvalidInputError, SamplingParams

        llm, demo = load_llm(args, console)
        with llm:  # stops the preprocessing threads on the way out
            if demo == "random":
                console.print("[yellow]demo model: random weights made on this machine. The replies are noise; "
                              "the engine is real.[/yellow]")
            elif demo:
                console.print("[yellow]demo model: a 5M-parameter Qwen2-VL trained on pictures of shapes. Ask what "
                              "shape the red object is, what colour the circle is, how many stars there are "
                              "(appendix A1 measures how often it is right).[/yellow]")
            if args.quantization or args.kv_cache_dtype != "auto":
                stats = llm.stats()
                console.print(f"[dim]weights: {args.quantization or 'as stored'}; KV cache: {stats['kv_cache_dtype']}, "
                              f"{stats['kv_bytes_per_token']:,} bytes per token (lesson 09)[/dim]")
            if args.compression:
                console.print(f"[dim]visual tokens: {args.compression['method']} keeps "
                              f"{args.compression['keep_ratio']:.0%} of each picture's (lesson 10)[/dim]")
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
            chat = Chat(llm, params, console, interactive)
            attachments = [(chat.attach, path) for path in args.image] + [(chat.attach_video, p) for p in args.video]
            for attach, path in attachments:
                try:
                    attach(path)
                except InvalidInputError as exc:
                    chat.say(f"[red]{exc}[/red]")
            if interactive:
                console.print("type a message, or /help")
            run(chat, interactive_lines(console) if interactive else sys.stdin)
        if args.trace:  # written as the LLM closed
            console.print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
        return 0
    except Exception as exc:  # noqa: BLE001 - one sentence for the user; --debug for the traceback
        if args.debug:
            traceback.print_exc()
        console.print(f"[red]error: {one_sentence(exc)}[/red]")
        return 1


def one_sentence(exc: Exception) -> str:
    name = type(exc).__name__
    if "OutOfMemory" in name or isinstance(exc, MemoryError):
        return "out of memory while loading the model; try --dtype bfloat16, a smaller model, or --device cpu"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    return text if name in ("CheckpointError", "InvalidInputError", "ValueError") else f"{name}: {text}"


if __name__ == "__main__":
    sys.exit(main())

"""Write a random-weight Qwen2-VL checkpoint folder (Hugging Face layout) for tests, lessons and benchmarks.

    python scripts/make_checkpoint.py --preset tiny --out checkpoints/tiny
    python scripts/make_checkpoint.py --preset small --out checkpoints/small --layout new --config-style nested \
        --shards 2 --dtype bfloat16 --seed 0 --set num_hidden_layers=2 --set vision_config.depth=1
    python scripts/make_checkpoint.py --preset tiny --text-only --out checkpoints/tiny-text   # Qwen2ForCausalLM

Draft models for speculative decoding, made of a target's first decoder layers (the target may be a hub id):

    python scripts/make_checkpoint.py --draft-from checkpoints/small --draft-layers 2 --out checkpoints/small-draft
    python scripts/make_checkpoint.py --draft-from checkpoints/small --draft-layers 2 --text-only --out ...

The work is done by nanomm.tools.random_checkpoint.make_checkpoint and
nanomm.tools.draft_checkpoint.make_draft_checkpoint; this is their command line.
"""

import argparse
import json
import time


from nanomm.tools.draft_checkpoint import make_draft_checkpoint
from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.tools.weights import PRESETS, checkpoint_size
from nanomm.model.config import ModelConfig


def parse_set(item: str) -> tuple[str, object]:
    """"key=value" with a JSON value when it parses as one (2, 1e-6, true, [8,12,12]), else a string."""
    key, sep, value = item.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {item!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="tiny")
    p.add_argument("--out", required=True, help="folder to write (created if missing)")
    p.add_argument("--layout", choices=["original", "new"], default="original",
                   help="weight names: original (model.*, visual.*) or new (model.language_model.*, model.visual.*)")
    p.add_argument("--config-style", choices=["flat", "nested"], default="flat")
    p.add_argument("--preprocessor-style", choices=["old", "new"], default="old")
    p.add_argument("--tie", choices=["preset", "true", "false"], default="preset", help="tie_word_embeddings")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--tokenizer", choices=["auto", "tiny", "qwen"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", type=parse_set, action="append", default=[], metavar="KEY=VALUE",
                   help="override a model field, e.g. num_hidden_layers=2 or vision_config.depth=1 (repeatable)")
    p.add_argument("--text-only", action="store_true",
                   help="write a text-only Qwen2 checkpoint (Qwen2ForCausalLM, no vision tower), same tokenizer")
    p.add_argument("--draft-from", metavar="TARGET",
                   help="a draft model instead: the first --draft-layers decoder layers of this checkpoint "
                        "(folder or hub id; the random-weight options above do not apply)")
    p.add_argument("--draft-layers", type=int, metavar="N", help="decoder layers the draft keeps (with --draft-from)")
    args = p.parse_args(argv)
    if (args.draft_from is None) != (args.draft_layers is None):
        p.error("--draft-from and --draft-layers go together")

    start = time.perf_counter()
    try:
        if args.draft_from:
            folder = make_draft_checkpoint(args.draft_from, args.out, args.draft_layers, text_only=args.text_only)
            what = f"first {args.draft_layers} layers of {args.draft_from}"
        else:
            folder = make_checkpoint(args.out, args.preset, seed=args.seed, layout=args.layout,
                                     config_style=args.config_style, preprocessor_style=args.preprocessor_style,
                                     tie_word_embeddings=None if args.tie == "preset" else args.tie == "true",
                                     num_shards=args.shards, tokenizer=args.tokenizer,
                                     overrides=dict(args.overrides), dtype=args.dtype, text_only=args.text_only)
            what = f"{args.preset}, {args.dtype}"
    except (ValueError, RuntimeError) as e:  # a bad field or value: say so without a traceback
        p.error(str(e))
    params, nbytes = checkpoint_size(folder)
    kind = "vision-language" if ModelConfig.from_pretrained(folder).has_vision else "text-only"
    print(f"wrote {folder}  ({what}, {kind}: {params:,} parameters, {nbytes / 2**20:,.1f} MiB of weights, "
          f"{time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()

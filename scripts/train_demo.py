"""Train a demo model (a small Qwen2-VL that answers questions about shapes) on the CPU.

    python scripts/train_demo.py --out runs/demo --threads 2     # a new run (its folder is created)
    python scripts/train_demo.py --out runs/demo --threads 2     # run again: resumes from runs/demo/train_state.pt
    python scripts/train_demo.py --out runs/demo --threads 2 --focus-start 3700 --focus 500:colour \
        --focus 600:all --focus 400:left_right,above_below --focus 400:all  # the 6ad4f33 model's recipe (*)
    python scripts/train_demo.py --out runs/draft --draft-of runs/demo --steps 400 --curriculum-steps 0  # its draft
    python scripts/train_demo.py --out runs/count --init-from /tmp/6ad4f33 --focus-start 0 \
        --focus 2700:count,compare --counting-chats 0.9   # appendix A2 section 5's first phases
    python scripts/train_demo.py --out runs/more --init-from nanomm/demo/checkpoints/model --focus-start 0 \
        --focus 600:number --focus 300:all --counting-chats 0 --focus-lr 1e-4   # more of the printed number
    python scripts/train_demo.py --out runs/nh1 --init-from nanomm/demo/checkpoints/model --focus-start 0 \
        --focus 3000:all --number-chats 0.5 --focus-lr 2e-4   # numbers among every task (tried, not shipped)
    python scripts/train_demo.py --out runs/p256 --init-from nanomm/demo/checkpoints/model --focus-start 0 \
        --focus 1400:all --number-chats 0.5 --counting-chats 0.2 --focus-lr 2e-4 --max-visual-tokens 256  # a larger cap
    python scripts/train_demo.py --out runs/fonts --init-from nanomm/demo/checkpoints/model --focus-start 0 \
        --focus 300:number --number-chats 0.5 --number-close-ups 16 --focus-lr 2e-4 --max-visual-tokens 400 \
        --number-fonts matplotlib   # digits in more fonts (tried, not shipped)
    python scripts/train_demo.py --out runs/gpu --init-from nanomm/demo/checkpoints/model --focus-start 0 \
        --focus 50000:all --number-chats 0.5 --counting-chats 0.45 --batch-size 32 --number-close-ups 32 \
        --focus-lr 2e-4 --max-visual-tokens 400 --number-fonts matplotlib --device cuda --batch-workers 13 \
        --time-limit 300      # on a GPU for five minutes (tried, not shipped)
    python scripts/train_demo.py --out runs/tiny --tiny --steps 20       # a tiny model: seconds, for a smoke run

(*) With the code of commit 6ad4f33, which trained the model shipped there. Since then the tower's hint head
also learns how many shapes of its kind a token's shape has and where shapes' centres are, and names every digit
of the printed number (`token_hints`), so the same command today trains a slightly different model. The model
shipped now is that 6ad4f33 model after 6,750 more steps of stage 3 from its weights: BENCHMARKS.md ("How the demo
model was made") has the eight commands and what else was tried, appendix A2 section 5 the story.

The recipe is in nanomm/workshop/training.py (data, loss, the vision hints) and nanomm/workshop/trainer.py (the loop).
Stage 1 (--vision-steps) trains the vision tower alone on the hints; stage 2 trains the whole model on the
answers, with the hints and the position loss beside them; stage 3 (--focus phases, from --focus-start) trains
it on pictures with several shapes, a few tasks at a time, each asked about several shapes in a chat.
Reproducible from --seed: each step's batch depends only on (seed, step). The result is
runs/demo/model.safetensors (float16) beside its config and tokenizer, loadable by nanomm and transformers;
nanomm/demo/checkpoints/ holds the shipped one.

On a GPU (--device cuda) the batches are still drawn on CPUs, by --batch-workers processes; --time-limit ends a run
after that many seconds with its state saved and its weights exported (a lent machine's minutes are counted).

Keep it alone on the machine: a second busy process on a 2-core VM slows every step. On the 2-core Intel Xeon
VM that trained the 6ad4f33 model (AMX, so --bf16 is on by default there), stage 1 ran at about 0.75 s per step
and stage 2 at about 1.3 s; with OMP_WAIT_POLICY=PASSIVE stage 2 ran at 2.0 s per step (its many small ops each
wait for a sleeping OpenMP thread), so leave the policy at its default.
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch


from nanomm.bench.machine import cpu_name
from nanomm.workshop.trainer import STATE_FILE, TINY_SPEC, export, new_run, set_picture_cap, train
from nanomm.demo.scenes import FONT_FILE_SUFFIXES
from nanomm.demo.tasks import TASKS
from nanomm.workshop.training import TrainConfig
from nanomm.tools.draft_checkpoint import make_draft_checkpoint


def focus_phase(text: str) -> tuple[int, tuple[str, ...]]:
    """"500:colour" -> (500, ("colour",)); "300:count,colour" -> (300, ("count", "colour")); "600:all": every task."""
    steps, names = text.split(":")
    tasks = TASKS if names == "all" else tuple(names.split(","))
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise SystemExit(f"--focus {text}: unknown tasks {sorted(unknown)}; the tasks are {', '.join(TASKS)} or all")
    return int(steps), tasks


# matplotlib's own fonts with digits, DejaVu left out: the independent test pictures (other_renderer.py) use it.
MATPLOTLIB_FONTS = ("STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf",
                    "cmr10.ttf", "cmss10.ttf", "cmtt10.ttf", "cmb10.ttf", "cmti10.ttf")


def number_fonts(names: list[str]) -> tuple[str, ...]:
    """--number-fonts as absolute font files: 'matplotlib' stands for MATPLOTLIB_FONTS; a missing file is an error."""
    files = []
    for name in names:
        if name == "matplotlib":
            try:
                import matplotlib
            except ImportError:
                raise SystemExit("--number-fonts matplotlib needs matplotlib: pip install -e '.[lessons]'")
            folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
            files += [str(folder / font) for font in MATPLOTLIB_FONTS]
        else:
            files.append(str(Path(name).resolve()))
    for file in files:
        if not Path(file).is_file() or not file.lower().endswith(FONT_FILE_SUFFIXES):
            raise SystemExit(f"--number-fonts: {file} is not a .ttf or .otf file")
    return tuple(files)


def at_least_one(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return int(text)


def default_bf16(device: str) -> bool:
    """bfloat16 autocast by default on a GPU, and on a CPU with AMX tiles or AVX512-BF16 (a step of the demo model
    at batch 16 with 16 close-ups: 2.9 s against 5.0 s in float32 on a 2-core AMD EPYC with AVX512-BF16);
    elsewhere float32."""
    if device.startswith("cuda"):
        return True
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="run folder (created, or resumed if it has a state)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    parser.add_argument("--curriculum-steps", type=int, default=TrainConfig.curriculum_steps)
    parser.add_argument("--vision-steps", type=int, default=TrainConfig.vision_steps,
                        help="stage 1: the first steps train the vision tower alone, on the hints")
    parser.add_argument("--vision-lr", type=float, default=TrainConfig.vision_lr)
    parser.add_argument("--focus", action="append", default=[], metavar="STEPS:TASK[,TASK...]",
                        help="a phase of stage 3: STEPS steps asking only these tasks (repeat for more phases)")
    parser.add_argument("--focus-start", type=int, help="the step stage 3 begins at (default: --steps)")
    parser.add_argument("--focus-lr", type=float, default=TrainConfig.focus_lr)
    parser.add_argument("--counting-chats", type=float, default=TrainConfig.counting_chats,
                        help="in a phase asking count: the share of chats about 0-6 shapes of one kind (default 0)")
    parser.add_argument("--number-chats", type=float, default=TrainConfig.number_chats,
                        help="in a phase asking number: the share of chats (after counting chats) about a picture "
                             "with a number (default 0)")
    parser.add_argument("--number-close-ups", type=int, default=TrainConfig.number_close_ups,
                        help="extra chats per batch about a small picture around a printed number (default 0)")
    parser.add_argument("--number-fonts", nargs="+", default=[], metavar="FONT",
                        help="font files (.ttf/.otf) that half the printed numbers are drawn in; 'matplotlib': "
                             "its STIX and Computer Modern fonts (the lessons extra), not its DejaVu")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="bfloat16 autocast (default: on a GPU, and where the CPU has AMX tiles or AVX512-BF16, "
                             "where it is faster)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: train on a GPU (default cpu)")
    parser.add_argument("--batch-workers", type=at_least_one, default=1,
                        help="processes drawing batches ahead (default 1; on a GPU, whose step is shorter than "
                             "drawing a batch, several)")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="end the run at the first step after this many seconds, save its state and export it")
    parser.add_argument("--save-every", type=int, default=TrainConfig.save_every)
    parser.add_argument("--stop-at", type=int, help="end the run (unexported) before this step; resume it later")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-flush-denormal", action="store_true",
                        help="keep denormal floats (slower; how the first 1000 steps of the shipped models ran)")
    parser.add_argument("--init-from", type=Path,
                        help="start a new run from a trained checkpoint's weights (fresh optimizer; use with --focus)")
    parser.add_argument("--draft-of", type=Path, help="train a draft model from this trained model's folder")
    parser.add_argument("--draft-layers", type=int, default=1, help="decoder layers the draft keeps")
    parser.add_argument("--max-visual-tokens", type=int,
                        help="cap the run's pictures at this many visual tokens from now on (written to its "
                             "preprocessor_config.json; a new run starts at 144)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (for tests): 2 small layers")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                      curriculum_steps=args.curriculum_steps, save_every=args.save_every, seed=args.seed,
                      vision_steps=0 if args.draft_of else args.vision_steps, vision_lr=args.vision_lr,
                      bf16=default_bf16(args.device) if args.bf16 is None else args.bf16,
                      device=args.device, batch_workers=args.batch_workers, time_limit=args.time_limit,
                      threads=args.threads, freeze_vision=args.draft_of is not None,
                      flush_denormal=not args.no_flush_denormal, focus_start=args.focus_start,
                      focus_phases=tuple(focus_phase(p) for p in args.focus), focus_lr=args.focus_lr,
                      counting_chats=args.counting_chats, number_chats=args.number_chats,
                      number_close_ups=args.number_close_ups, number_fonts=number_fonts(args.number_fonts))
    if not (args.out / "config.json").is_file():
        if args.init_from:
            # The Hub files and weights, not a training state: the new run starts at step 0.
            shutil.copytree(args.init_from, args.out, ignore=shutil.ignore_patterns(STATE_FILE + "*"),
                            dirs_exist_ok=True)
        elif args.draft_of:
            make_draft_checkpoint(args.draft_of, args.out, args.draft_layers)  # the target's first layers
        else:
            new_run(args.out, TINY_SPEC if args.tiny else None, seed=args.seed)
    if args.max_visual_tokens:
        set_picture_cap(args.out, args.max_visual_tokens)
    began = time.perf_counter()
    result = train(args.out, cfg, show_progress=not args.no_progress, stop_before=args.stop_at)
    if args.stop_at is not None and args.stop_at < cfg.total_steps:
        return  # the last saved state (every --save-every steps) is where the next run resumes
    export(result["model"], args.out)
    gpu = f", {torch.cuda.get_device_name(cfg.device)}" if cfg.device.startswith("cuda") else ""
    last_losses = result["losses"][-50:]
    summary = {"steps": result["steps"], "resumed_at": result["first_step"],
               "seconds": round(time.perf_counter() - began, 1),
               "final_loss": sum(last_losses) / len(last_losses) if last_losses else None,  # None: no step ran
               "machine": f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                          f"{torch.get_num_threads()} threads{gpu}", "config": cfg.to_dict()}
    (args.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}))


if __name__ == "__main__":
    main()

"""The demo model's training loop: a new checkpoint folder, AdamW steps with a live loss bar, resume, export.

Lesson: lessons/A2-how-the-demo-model-was-made.md. scripts/train_demo.py is the command line; nanomm/workshop/training.py
makes the batches and the loss.

A run lives in one folder: the Hub files (config.json, tokenizer, preprocessor_config.json, ...) written at
the start, `train_state.pt` (weights, optimizer, step) saved every `save_every` steps so that a killed run
resumes where it stopped, and at the end `model.safetensors` in float16, which is what nanomm and transformers
load.
"""

from __future__ import annotations

import functools
import json
import os
import random
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from nanomm.demo.scenes import random_scene
from nanomm.demo.tasks import compare_questions, scene_questions, vary
from nanomm.workshop.training import HINT_OUTPUTS, TrainConfig, batch_loss, learning_rate, make_batch, stage
from nanomm.inputs.image import ImageProcessorConfig
from nanomm.inputs.tokenizer import Tokenizer
from nanomm.model.config import VisionConfig
from nanomm.model.loader import canonical_name, load_model
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.model.rope import inverse_frequencies
from nanomm.tools.hf_files import flat_config, generation_config, preprocessor_config, write_json
from nanomm.tools.tokenizers import TINY_CORPUS, build_bpe_tokenizer, write_tokenizer_files
from nanomm.tools.weights import model_spec, random_weights, save_safetensors

# The demo model's shape: 5.1M parameters. M-RoPE: head_dim 64 = 2 * (2 + 6 + 24) rotary pairs for (t, h, w) and
# rope_theta 1e4. Qwen2-VL-2B's split scaled down ([8, 12, 12], theta 1e6) gives the column axis only the slowest
# pairs, which turn by at most 0.0002 rad from one column to the next: to the language model every column of a
# picture would sit at the same place, and "left of" could not be learned. Here the fastest column pair turns
# 0.1 rad per column and the fastest row pairs 0.56 rad per row, while the pairs from 20 on (under 0.004 rad per
# token) still let attention match content across a chat.
DEMO_SPEC = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "mrope_section": [2, 6, 24], "rope_theta": 10000.0, "tie_word_embeddings": True,
             "max_position_embeddings": 4096,
             "vision_config": {"depth": 4, "embed_dim": 192, "num_heads": 3, "patch_size": 7, "spatial_merge_size": 2,
                               "hidden_act": "gelu"}}
# 7-pixel patches: with Qwen2-VL's 14-pixel patches a vision transformer trained from scratch on a CPU's worth of
# pictures did not learn what a shape is; with 7-pixel patches it does. A visual token is then a 14x14-pixel block
# (2x2 patches). "gelu" (one kernel) instead of "quick_gelu" (three) trains about 1.3x faster; both are Qwen2-VL.
TOKEN_PIXELS = DEMO_SPEC["vision_config"]["patch_size"] * DEMO_SPEC["vision_config"]["spatial_merge_size"]  # 14
# A tiny variant with the same tokenizer and pictures, for tests: a few training steps take seconds.
TINY_SPEC = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "mrope_section": [4, 2, 2],
             "vision_config": {"depth": 1, "embed_dim": 32, "num_heads": 2}}
# A new run caps its pictures at 144 visual tokens (168x168 pixels): the shipped model's default, and the most it
# was trained on. Runs at larger caps (`--max-visual-tokens`, set_picture_cap) were tried (BENCHMARKS.md, "How the demo
# model was made").
DEMO_MAX_PIXELS = 144 * TOKEN_PIXELS ** 2
DEMO_MIN_PIXELS = 16 * TOKEN_PIXELS ** 2
VOCAB_SIZE = 768
STATE_FILE = "train_state.pt"


def tokenizer_corpus(seed: int = 0, chats: int = 3000) -> list[str]:
    """Text the demo tokenizer is trained on: every question form and answer, with the casing variants (a few
    thousand scenes' worth of questions; nothing is drawn)."""
    rng, texts = random.Random(seed), [TINY_CORPUS]
    for _ in range(chats):
        scene = random_scene(rng)
        qas = [qa for qas in scene_questions(scene).values() for qa in qas]
        qas += compare_questions(scene, random_scene(rng))
        texts += [f"{vary(qa.question, rng)}\n{qa.answer}\n" for qa in qas]
    return texts


def new_run(folder: Path, spec_overrides: dict | None = None, seed: int = 0) -> Path:
    """Write the Hub files and random initial weights of a new model into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    special_ids, vocab = write_tokenizer_files(build_bpe_tokenizer(tokenizer_corpus(seed), VOCAB_SIZE), folder)
    spec = model_spec("tiny", {**DEMO_SPEC, "vocab_size": vocab, **(spec_overrides or {})})
    write_json(folder / "config.json", flat_config(spec, special_ids, "float32"))
    write_json(folder / "generation_config.json", generation_config(special_ids))
    preprocessor = preprocessor_config(spec, "old") | {"min_pixels": DEMO_MIN_PIXELS, "max_pixels": DEMO_MAX_PIXELS}
    write_json(folder / "preprocessor_config.json", preprocessor)
    save_safetensors(local_attention_init(random_weights(spec, seed), spec), folder / "model.safetensors")
    return folder


def set_picture_cap(folder: Path, visual_tokens: int) -> None:
    """Cap a run's pictures at this many visual tokens: its preprocessor_config.json's max_pixels, which training
    (`training_cap`) and serving both read."""
    path, token_pixels = folder / "preprocessor_config.json", ImageProcessorConfig.from_pretrained(folder).factor
    write_json(path, json.loads(path.read_text()) | {"max_pixels": visual_tokens * token_pixels ** 2})


# Where each vision head looks first, by block: (rows, columns) from the patch itself. A tap per head, like a
# convolution's, growing from 1 to 2 patches away with depth.
LOCAL_OFFSETS = ((0, 1), (1, 0), (0, -1), (-1, 0), (1, 1), (-1, -1), (0, 2), (2, 0), (0, -2), (-2, 0), (2, 2), (-2, -2))


def local_attention_init(weights: dict, spec: dict, strength: float = 6.0, content_scale: float = 0.1) -> dict:
    """Start each vision attention head looking at one neighbouring patch, as a convolution would.

    A vision transformer from scratch has no idea that nearby pixels belong together, and learns shapes slowly
    on a CPU's worth of pictures. Here every head starts as a tap at one offset (LOCAL_OFFSETS), and
    training moves it from there: the idea of ConViT (d'Ascoli et al., 2021), done with the weights alone. With
    2-D rotary positions, a query bias a*e^{i*theta*d} against a key bias a makes the score a^2*cos(theta*(delta - d))
    in every rotary pair, largest when the key is d patches away; the content part of q and k starts small
    (content_scale). Only initial values change: the checkpoint is a plain Qwen2-VL."""
    vision = spec["vision_config"]
    embed, heads = vision["embed_dim"], vision["num_heads"]
    head_dim = embed // heads
    theta = inverse_frequencies(head_dim // 2, VisionConfig.rope_theta)  # the tower's rotary frequencies, per axis
    taps = iter(LOCAL_OFFSETS * (vision["depth"] * heads))
    for block in range(vision["depth"]):
        weight, bias = (weights[f"visual.blocks.{block}.attn.qkv.{name}"] for name in ("weight", "bias"))
        for head in range(heads):
            rows, cols = next(taps)
            q = slice(head * head_dim, (head + 1) * head_dim)  # rows of qkv: q, then k (embed further), then v
            k = slice(embed + q.start, embed + q.stop)
            weight[q] *= content_scale
            weight[k] *= content_scale
            angle = torch.cat([theta * rows, theta * cols])  # (head_dim/2,): the first half rotates by row
            bias[q] = torch.cat([strength * angle.cos(), strength * angle.sin()])
            bias[k] = torch.cat([torch.full_like(angle, strength), torch.zeros_like(angle)])
    return weights


def export(model: Qwen2VL, folder: Path, dtype: torch.dtype = torch.float16) -> None:
    """model.safetensors in the original Hub names (model.*, visual.*), in `dtype`; config.json says so."""
    state = {}
    for name, tensor in model.state_dict().items():  # the textbook model holds the checkpoint's matrices
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        hub_name = "model." + name.removeprefix("language_model.") if name.startswith("language_model.") else name
        assert canonical_name(hub_name) == name, (hub_name, name)
        state[hub_name] = tensor.detach().to("cpu", dtype).contiguous()
    save_safetensors(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_json(folder / "config.json", config)


def train(folder: Path, cfg: TrainConfig, *, show_progress: bool = True, log=functools.partial(print, flush=True),
          stop_before: int | None = None) -> dict:
    """Train the model in folder to step cfg.total_steps (resuming from train_state.pt if present), or until
    cfg.time_limit seconds have passed (then its state is saved where it stopped). Returns a summary: "steps" is
    the step it reached.

    stop_before: end the run before that step without saving, as if it were killed (tests of resuming)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.set_flush_denormal(cfg.flush_denormal)  # measured: 1.4 instead of 2.2 s per step once training warms up
    torch.manual_seed(cfg.seed)
    model = load_model(folder, device=cfg.device).float().train()
    heads = None if cfg.freeze_vision or not cfg.hint_weight else new_heads(model, cfg.seed).to(cfg.device)
    trainable = _trainable_parameters(model, cfg) + (list(heads.parameters()) if heads else [])
    vision = {id(p) for p in model.visual.parameters()}  # the tower and its hint head: their own learning rate
    vision |= {id(p) for p in heads["hints"].parameters()} if heads else set()
    optimizer = torch.optim.AdamW(_param_groups(trainable, cfg.weight_decay, vision), lr=cfg.lr, betas=(0.9, 0.98))
    start = _resume(folder, model, optimizer, heads, cfg, log)
    history, window, began = [], {}, time.perf_counter()
    # Batches are drawn in other processes (cfg.batch_workers), as many steps ahead, while this one computes.
    # Spawned workers, not forked ones: a fork after torch has started its OpenMP threads can hang the child.
    workers = ProcessPoolExecutor(cfg.batch_workers, mp_context=get_context("spawn"), initializer=_init_batch_worker)
    with _progress(show_progress) as progress, workers as pool:
        end = cfg.total_steps if stop_before is None else min(stop_before, cfg.total_steps)
        bar = progress.add_task("training", total=cfg.total_steps, completed=start, loss=float("nan"))
        batches = BatchesAhead(pool, folder, cfg, start, end)
        for step in range(start, end):
            if cfg.time_limit is not None and time.perf_counter() - began > cfg.time_limit:
                _save_state(folder, model, optimizer, heads, step, cfg)  # out of time: resumable from here
                log(f"step {step}: out of time ({cfg.time_limit:.0f} s), stopping")
                batches.cancel()
                break
            loss, accuracy = _train_step(model, heads, optimizer, trainable, step, cfg, batches.take())
            history.append(loss)
            _accumulate(window, accuracy)
            progress.update(bar, advance=1, loss=sum(history[-50:]) / len(history[-50:]))
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.total_steps:
                _save_state(folder, model, optimizer, heads, step + 1, cfg)
                log(f"step {step + 1} ({time.perf_counter() - began:.0f} s): loss "
                    f"{sum(history[-50:]) / len(history[-50:]):.3f}  first-token accuracy "
                    + " ".join(f"{t} {r / n:.2f}" for t, (r, n) in window.items() if n))
                window = {}
    return {"steps": start + len(history), "first_step": start, "seconds": time.perf_counter() - began,
            "losses": history, "model": model}


class BatchesAhead:
    """The batches of steps start..end-1, in order, each drawn by the worker pool cfg.batch_workers steps ahead."""

    def __init__(self, pool: ProcessPoolExecutor, folder: Path, cfg: TrainConfig, start: int, end: int):
        self.pool, self.folder, self.cfg, self.end = pool, str(folder), cfg, end
        self.next_step = min(end, start + cfg.batch_workers)  # the first step not yet sent to a worker
        self.pending = deque(self._draw(step) for step in range(start, self.next_step))

    def _draw(self, step: int):
        return self.pool.submit(_make_batch_in_worker, self.folder, step, self.cfg)

    def take(self) -> list:
        """The next step's batch (waiting for it if need be); one more step is sent off in its place."""
        future = self.pending.popleft()
        if self.next_step < self.end:
            self.pending.append(self._draw(self.next_step))
            self.next_step += 1
        return future.result()

    def cancel(self) -> None:
        for future in self.pending:
            future.cancel()


@functools.lru_cache(maxsize=2)
def _processors(folder: str) -> tuple[Tokenizer, ImageProcessorConfig]:
    return Tokenizer.from_pretrained(folder), ImageProcessorConfig.from_pretrained(folder)


def _init_batch_worker() -> None:
    """One thread, and a lower priority: the training step's threads must not wait on the batch worker."""
    torch.set_num_threads(1)
    os.nice(5)


def _make_batch_in_worker(folder: str, step: int, cfg: TrainConfig):
    return make_batch(step, cfg, *_processors(folder))


def new_heads(model: Qwen2VL, seed: int) -> torch.nn.ModuleDict:
    """The training-only heads, dropped at export: "hints" reads what lies under each visual token off the
    tower's output (training.py, `token_hints`); "position" reads each image token's place in its picture off
    the language model's middle layer (training.py, `image_token_places`)."""
    torch.manual_seed(seed)
    hidden = model.config.text.hidden_size
    return torch.nn.ModuleDict({"hints": torch.nn.Linear(hidden, HINT_OUTPUTS), "position": torch.nn.Linear(hidden, 2)})


def _train_step(model, heads, optimizer, trainable, step, cfg, batch):
    for group in optimizer.param_groups:
        scale = cfg.vision_lr_scale if group["vision"] and stage(step, cfg) == 2 else 1.0
        group["lr"] = scale * learning_rate(step, cfg)
    with torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=cfg.bf16):
        loss, accuracy = batch_loss(model, batch, heads, cfg.hint_weight, vision_only=stage(step, cfg) == 1,
                                    position_weight=cfg.position_weight)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
    optimizer.step()
    return loss.item(), accuracy


def _trainable_parameters(model: Qwen2VL, cfg: TrainConfig) -> list[torch.nn.Parameter]:
    for name, p in model.named_parameters():
        p.requires_grad_(not (cfg.freeze_vision and name.startswith("visual.")))
    return [p for p in model.parameters() if p.requires_grad]


def _param_groups(params, weight_decay: float, vision: set[int]) -> list[dict]:
    """Weight decay on matrices only, not on norms and biases; the vision tower and hint head in groups of their
    own (after stage 1 they learn at cfg.vision_lr_scale of the language model's rate)."""
    groups = []
    for in_vision in (True, False):
        mine = [p for p in params if (id(p) in vision) == in_vision]
        groups += [{"params": [p for p in mine if p.dim() >= 2], "weight_decay": weight_decay, "vision": in_vision},
                   {"params": [p for p in mine if p.dim() < 2], "weight_decay": 0.0, "vision": in_vision}]
    return [g for g in groups if g["params"]]


def _accumulate(window: dict, accuracy: dict) -> None:
    for task, (right, total) in accuracy.items():
        r, n = window.get(task, (0, 0))
        window[task] = (r + right, n + total)


# How a run runs, not what it learns: these may change from one resume to the next without a word.
RUN_SETTINGS = ("threads", "save_every", "device", "batch_workers", "time_limit")


def recipe_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """The recipe's settings that differ between a saved state's config and this run's, as "name: saved -> now"."""
    now = cfg.to_dict()
    return [f"{name}: {saved[name]!r} -> {now[name]!r}" for name in now
            if name not in RUN_SETTINGS and name in saved and saved[name] != now[name]]


def _resume(folder: Path, model, optimizer, heads, cfg: TrainConfig, log) -> int:
    path = folder / STATE_FILE
    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=False, map_location="cpu")  # load_state_dict moves it to the model
    changes = recipe_changes(state.get("config") or {}, cfg)
    if changes:  # allowed (adding a --focus phase is how a run is extended), but said: the run is no longer one recipe
        log(f"resuming {path} at step {state['step']} with a different recipe: " + "; ".join(changes))
    model.load_state_dict(state["model"])
    if heads is not None:
        saved = state["heads"]["hints.weight"].shape[0]
        if saved != HINT_OUTPUTS:
            raise SystemExit(f"{path} was saved with a {saved}-wide hint head and this code's is {HINT_OUTPUTS} "
                             "(the hints changed): start a new run from its weights with --init-from")
        heads.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def _save_state(folder: Path, model, optimizer, heads, step: int, cfg: TrainConfig) -> None:
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "heads": heads.state_dict() if heads else None, "config": cfg.to_dict()}, tmp)
    tmp.replace(folder / STATE_FILE)  # atomic: a kill mid-save leaves the previous state


def _progress(show: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    disable=not show)

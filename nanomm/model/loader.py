"""Load a Qwen2-VL or text-only Qwen2 checkpoint (HF layout, safetensors only) from a local folder or a hub id.

Lesson: lessons/02-vision-encoder.md (where the weights come from).

Two on-disk name layouts exist. The original checkpoints use `model.*` (language model), `visual.*` and
`lm_head.weight`; checkpoints saved by transformers ~4.52-4.57 use `model.language_model.*` and
`model.visual.*`. Both map onto nanomm's module names `language_model.*`, `visual.*`, `lm_head.weight`.
Tied checkpoints (Qwen2-VL-2B) store no `lm_head.weight`: the head reuses the token embedding.
Text-only Qwen2 checkpoints (Qwen2ForCausalLM: `model.*`, `lm_head.weight`) load through the same path into a
`Qwen2VL` with no vision tower (see config.py); they serve as draft models for speculative decoding.

Weights are read with safetensors, never unpickled. The model is built on the meta device and the loaded
tensors are assigned directly, so a checkpoint is held in memory once, in the requested dtype and device.
"""

import os
from pathlib import Path

import torch
from safetensors import safe_open

from nanomm.model.config import ModelConfig, read_checkpoint_json
from nanomm.errors import CheckpointError
from nanomm.model.qwen2_vl import Qwen2VL

HUB_FILES = ["*.json", "*.safetensors", "merges.txt", "vocab.json", "tokenizer*"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Keys some exports carry that hold nothing the model needs (rotary tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None,
                       download_dir: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """A local folder as is, or a hub id downloaded (config, safetensors and tokenizer files only, or only
    allow_patterns) into download_dir (None: the Hugging Face cache)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_id)
    if path.exists():
        raise CheckpointError(f"{name} is a file; pass the checkpoint folder that holds config.json")
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointError(f"{name}: no such checkpoint folder (and not a hub id of the form 'org/name')")
    from huggingface_hub import snapshot_download  # imported here: only hub ids need it
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=allow_patterns or HUB_FILES,
                                      cache_dir=download_dir))
    except Exception as exc:  # offline, unknown repo, gated repo...: one clear sentence for the user
        raise CheckpointError(f"cannot download {name!r} from the Hugging Face hub ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'no details'}); "
                              f"pass a local checkpoint folder instead") from exc


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_checkpoint_json(index).get("weight_map") or {}
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = f" (found {pickled[0]}: nanomm never unpickles weights; convert it to safetensors)" if pickled else ""
        raise CheckpointError(f"{folder} has no .safetensors weights{hint}")
    return files


def canonical_name(name: str) -> str | None:
    """Map either on-disk layout onto nanomm's module names; None for keys that are not ours."""
    for prefix, replacement in (("model.visual.", "visual."), ("visual.", "visual."),
                                ("model.language_model.", "language_model."), ("language_model.", "language_model."),
                                ("model.", "language_model.")):
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name if name == "lm_head.weight" else None


def read_state_dict(folder: Path, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state, unexpected = {}, []
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                key = canonical_name(name)
                if key is None:
                    if not name.endswith(IGNORED_SUFFIXES):
                        unexpected.append(name)
                    continue
                state[key] = f.get_tensor(name).to(dtype)
    if unexpected:
        raise CheckpointError(f"{folder} has weights a Qwen2-VL or Qwen2 model does not: {unexpected[:5]}")
    return state


def load_model(path_or_id, device="cpu", dtype="float32", revision: str | None = None) -> Qwen2VL:
    folder = resolve_checkpoint(path_or_id, revision)
    config = ModelConfig.from_pretrained(folder)
    dtype, device = resolve_dtype(dtype), torch.device(device)
    with torch.device("meta"):
        model = Qwen2VL(config, name_or_path=str(path_or_id))
    state = read_state_dict(folder, device, dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the head is the embedding, whatever the file says
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, extra = expected - state.keys(), state.keys() - expected
    if missing or extra:
        raise CheckpointError(f"{folder} does not match its config.json: missing {sorted(missing)[:5]}, "
                              f"unexpected {sorted(extra)[:5]}")
    for key, tensor in state.items():
        want = model.get_parameter(key).shape
        if tensor.shape != want:
            raise CheckpointError(f"{folder}: {key} has shape {tuple(tensor.shape)}, config implies {tuple(want)}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)

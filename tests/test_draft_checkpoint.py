"""Draft checkpoints for speculative decoding: a target's first decoder layers, as a Qwen2-VL or a text-only Qwen2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transformers  # the oracle (dev extra); a missing oracle must fail, not skip
from nanomm.tools.draft_checkpoint import make_draft_checkpoint
from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.tools.weights import checkpoint_size
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.model.loader import load_model
from nanomm.reference import generate
from nanomm.sampling import SamplingParams
from nanomm.inputs.tokenizer import Tokenizer
from tests.helpers import random_image

ROOT = Path(__file__).resolve().parents[1]
TARGET_LAYERS = 3
TARGETS = {
    "flat-original-untied": dict(layout="original", config_style="flat"),
    "nested-new-tied-sharded-bf16": dict(layout="new", config_style="nested", tie_word_embeddings=True,
                                         num_shards=3, dtype="bfloat16", seed=1),
    "text-only": dict(text_only=True, seed=2),
}
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in this picture?<|im_end|>\n" \
         "<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), "tiny",
                           overrides={"num_hidden_layers": TARGET_LAYERS}, **TARGETS[request.param])


def run_greedy(model, folder, with_image: bool):
    """(logits of every generated token, tokens) for the prompt, with its image when with_image."""
    tokenizer = Tokenizer.from_pretrained(folder)
    ids = tokenizer.encode(PROMPT if with_image else PROMPT.replace("<|vision_start|><|image_pad|><|vision_end|>", ""))
    images = []
    if with_image:
        images = [preprocess_image(random_image(90, 60, seed=3), ImageProcessorConfig.from_pretrained(folder))]
        ids = tokenizer.expand_image_placeholders(ids, [images[0].num_tokens])
    out = generate(model, ids, images, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), keep_logits=True)
    return torch.stack(out.logits), out.token_ids


def test_full_depth_draft_computes_what_the_target_computes(target, tmp_path):
    draft = load_model(make_draft_checkpoint(target, tmp_path / "draft", TARGET_LAYERS))
    ours = load_model(target)
    with_image = ours.config.has_vision
    assert draft.config.has_vision == with_image
    target_logits, target_tokens = run_greedy(ours, target, with_image)
    draft_logits, draft_tokens = run_greedy(draft, tmp_path / "draft", with_image)
    assert torch.equal(draft_logits, target_logits) and draft_tokens == target_tokens


def test_full_depth_text_only_draft_of_a_vision_language_target(target, tmp_path):
    """Without its vision tower the draft still reads text as the target does (1-D RoPE = M-RoPE on text)."""
    draft = load_model(make_draft_checkpoint(target, tmp_path / "draft", TARGET_LAYERS, text_only=True))
    assert draft.visual is None
    target_logits, target_tokens = run_greedy(load_model(target), target, with_image=False)
    draft_logits, draft_tokens = run_greedy(draft, tmp_path / "draft", with_image=False)
    torch.testing.assert_close(draft_logits, target_logits, rtol=0, atol=1e-5)
    assert draft_tokens == target_tokens


@pytest.mark.parametrize("text_only", [False, True])
def test_shallow_draft_holds_the_targets_tensors(target, tmp_path, text_only):
    folder = make_draft_checkpoint(target, tmp_path / "draft", 1, text_only=text_only)
    draft, ours = load_model(folder), load_model(target)
    keeps_vision = ours.config.has_vision and not text_only
    assert draft.config.text.num_hidden_layers == 1 and len(draft.language_model.layers) == 1
    assert draft.config.has_vision == keeps_vision and (draft.visual is None) == (not keeps_vision)
    assert draft.config.tie_word_embeddings == ours.config.tie_word_embeddings
    target_state = ours.state_dict()
    expected = {k for k in target_state
                if not k.startswith("language_model.layers.") or k.startswith("language_model.layers.0.")}
    if not keeps_vision:
        expected = {k for k in expected if not k.startswith("visual.")}
    assert set(draft.state_dict()) == expected
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, target_state[name]), name
    assert checkpoint_size(folder)[1] < checkpoint_size(target)[1]


@pytest.mark.parametrize("text_only", [False, True])
def test_transformers_loads_the_draft(target, tmp_path, text_only):
    folder = make_draft_checkpoint(target, tmp_path / "draft", 2, text_only=text_only)
    config = json.loads((folder / "config.json").read_text())
    oracle_class = transformers.Qwen2VLForConditionalGeneration if config["model_type"] == "qwen2_vl" \
        else transformers.Qwen2ForCausalLM
    model, info = oracle_class.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    text_config = getattr(model.config, "text_config", model.config)
    assert text_config.num_hidden_layers == 2 and len(text_config.layer_types) == 2
    target_has_vision = load_model(target).config.has_vision
    assert config["model_type"] == ("qwen2_vl" if target_has_vision and not text_only else "qwen2")


@pytest.mark.parametrize("text_only", [False, True])
def test_draft_shares_the_tokenizer(target, tmp_path, text_only):
    folder = make_draft_checkpoint(target, tmp_path / "draft", 2, text_only=text_only)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json"):
        assert (folder / name).read_bytes() == (target / name).read_bytes(), name
    has_vision = load_model(folder).config.has_vision
    assert (folder / "preprocessor_config.json").exists() == has_vision
    draft_tok, target_tok = Tokenizer.from_pretrained(folder), Tokenizer.from_pretrained(target)
    assert draft_tok.encode(PROMPT) == target_tok.encode(PROMPT)


@pytest.mark.parametrize("num_layers", [0, TARGET_LAYERS + 1, -1, 1.5, True, "2"])
def test_bad_num_layers(target, tmp_path, num_layers):
    with pytest.raises(ValueError, match=f"num_layers must be an int from 1 to {TARGET_LAYERS}"):
        make_draft_checkpoint(target, tmp_path / "draft", num_layers)
    assert not (tmp_path / "draft").exists()


def test_draft_must_not_overwrite_its_target(target):
    with pytest.raises(ValueError, match="another folder"):
        make_draft_checkpoint(target, target, 1)


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "make_checkpoint.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


@pytest.mark.slow
def test_cli_text_only_and_draft(tmp_path):
    run = run_cli("--preset", "tiny", "--out", tmp_path / "target", "--set", "num_hidden_layers=3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    run = run_cli("--out", tmp_path / "draft", "--draft-from", tmp_path / "target", "--draft-layers", 2, "--text-only",
                  cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "first 2 layers" in run.stdout and "text-only" in run.stdout
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 2
    run = run_cli("--preset", "tiny", "--text-only", "--out", tmp_path / "text", cwd=tmp_path)
    assert run.returncode == 0 and "text-only" in run.stdout, run.stderr
    assert json.loads((tmp_path / "text" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]

    run = run_cli("--out", tmp_path / "bad", "--draft-from", tmp_path / "target", cwd=tmp_path)
    assert run.returncode == 2 and "--draft-from and --draft-layers go together" in run.stderr
    run = run_cli("--out", tmp_path / "bad", "--draft-from", tmp_path / "target", "--draft-layers", 9, cwd=tmp_path)
    assert run.returncode == 2 and "num_layers must be an int from 1 to 3" in run.stderr

"""Loading: both config layouts, both weight-name layouts, shards, dtypes, and a clear error for everything else."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import NO_NETWORK
from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.model.config import ModelConfig
from nanomm.errors import CheckpointError
from nanomm.model.loader import canonical_name, load_model


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


def test_flat_and_nested_configs_parse_to_the_same_model_config(tmp_path):
    flat = ModelConfig.from_pretrained(make_checkpoint(tmp_path / "flat", config_style="flat"))
    nested = ModelConfig.from_pretrained(make_checkpoint(tmp_path / "nested", config_style="nested"))
    assert flat.text == nested.text and flat.vision == nested.vision
    assert flat.image_token_id == nested.image_token_id != 151655  # the tiny tokenizer's id, read from config
    assert flat.eos_token_ids == nested.eos_token_ids and len(flat.eos_token_ids) == 2


def test_missing_fields_take_transformers_class_defaults():
    cfg = ModelConfig.from_dict({"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28,
                                 "num_key_value_heads": 4, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}})
    assert cfg.text.rms_norm_eps == 1e-5 and cfg.text.rope_theta == 1e6 and cfg.text.head_dim == 128
    assert cfg.vision.embed_dim == 1280 and cfg.vision.hidden_size == 3584 and cfg.vision.hidden_act == "quick_gelu"


@pytest.mark.parametrize("layout", ["original", "new"])
@pytest.mark.parametrize("tied", [True, False])
def test_both_name_layouts_load_the_same_weights(tmp_path, layout, tied):
    folder = make_checkpoint(tmp_path / "ck", layout=layout, tie_word_embeddings=tied, num_shards=2)
    model = load_model(folder)
    on_disk = {}
    for file in folder.glob("*.safetensors"):
        on_disk.update({canonical_name(k): v for k, v in load_file(file).items()})
    state = model.state_dict()  # the textbook model holds the checkpoint's own matrices
    for key, tensor in on_disk.items():
        assert torch.equal(state[key], tensor), key
    assert set(state) - {"lm_head.weight"} == set(on_disk) - {"lm_head.weight"}
    assert (model.lm_head.weight is model.language_model.embed_tokens.weight) == tied
    assert ("lm_head.weight" in on_disk) != tied


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", torch.bfloat16])
def test_dtypes(ckpt, dtype):
    model = load_model(ckpt, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)}


def test_bfloat16_file_loads_as_float32(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "bf16", dtype="bfloat16"), dtype="float32")
    assert model.lm_head.weight.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loads_onto_cuda(ckpt):
    model = load_model(ckpt, device="cuda", dtype="bfloat16")
    assert model.lm_head.weight.is_cuda


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_errors_name_the_problem(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        load_model(tmp_path / "does-not-exist")
    with pytest.raises(CheckpointError, match="is a file"):
        load_model(ckpt / "config.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(empty)


def test_another_family_is_refused(ckpt, tmp_path):
    folder = copy_of(ckpt, tmp_path)
    edit_config(folder, model_type="llava")
    with pytest.raises(CheckpointError, match="'llava'.*'qwen2_5_vl'"):
        load_model(folder)


def test_a_qwen2_vl_folder_that_claims_to_be_qwen2_5_vl_does_not_load(ckpt, tmp_path):
    """Its tower's weights (LayerNorm, fc1/fc2) are not the windowed tower's: named, not silently wrong."""
    folder = copy_of(ckpt, tmp_path)
    edit_config(folder, model_type="qwen2_5_vl")
    with pytest.raises(CheckpointError):
        load_model(folder)


def test_pickled_weights_are_refused(ckpt, tmp_path):
    folder = copy_of(ckpt, tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_model(folder)


def test_weights_that_do_not_match_the_config(ckpt, tmp_path):
    folder = copy_of(ckpt, tmp_path)
    edit_config(folder, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="missing"):
        load_model(folder)
    folder = copy_of(ckpt, tmp_path / "b")
    edit_config(folder, intermediate_size=96)
    with pytest.raises(CheckpointError, match="shape"):
        load_model(folder)
    folder = copy_of(ckpt, tmp_path / "c")
    weights = load_file(folder / "model.safetensors")
    weights["mystery.weight"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="mystery"):
        load_model(folder)


def test_unreachable_hub_id_is_a_clear_error(tmp_path):
    # huggingface_hub reads HF_HUB_OFFLINE once, when it is imported (huggingface_hub.constants.HF_HUB_OFFLINE):
    # setting it in this process after the import would change nothing. A child process has it from the start,
    # and an empty HF_HOME, so there is no cached snapshot to fall back on either.
    code = NO_NETWORK + """
from nanomm.errors import CheckpointError
from nanomm.model.loader import load_model
try:
    load_model("nanomm-test/no-such-model")
except CheckpointError as exc:
    print(f"CheckpointError: {exc}")
else:
    print("loaded without the hub?!")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "NETWORK ATTEMPT" not in proc.stderr, proc.stderr  # offline mode: not even a DNS lookup
    message = proc.stdout.strip()
    expected = "CheckpointError: cannot download 'nanomm-test/no-such-model' from the Hugging Face hub ("
    assert message.startswith(expected), message
    assert message.endswith("; pass a local checkpoint folder instead"), message
    assert "\n" not in message and "HF_HUB_OFFLINE" in message, message  # one line, and it names the cause

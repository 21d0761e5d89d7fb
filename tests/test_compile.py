"""LLM(compile=True) (nanomm/accel/compile.py): the compiled engine against the *eager* dense reference, under
every one of the engine's stress settings, and proof that compiled code ran."""

import pytest
import torch

from helpers import assert_mixed_workload_matches
from nanomm import LLM
from nanomm.model.loader import load_model
from test_engine import MAX_PIXELS, STRESS


@pytest.fixture(scope="module")
def eager_model(ckpt):
    return load_model(ckpt)  # its own copy: the engine's model is the compiled one


@pytest.mark.parametrize("setting", list(STRESS))
def test_compiled_engine_matches_the_eager_dense_reference(ckpt, eager_model, setting):
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]
    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=MAX_PIXELS, compile=True, **STRESS[setting])
    assert_mixed_workload_matches(llm, eager_model)
    if setting == "tiny-pool-preemption":
        assert llm.stats()["preemptions"] > 0
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames_before or setting != "default", \
        "no frame was compiled: the engine ran eagerly"


def test_compile_replaces_the_layers_forward_and_keeps_attention_eager(ckpt):
    with LLM(str(ckpt), compile=True) as llm:
        layer = llm.model.language_model.layers[0]
        assert "forward" in vars(layer) and hasattr(layer.forward, "_torchdynamo_orig_callable")
        assert type(layer.self_attn.qkv_proj) is torch.nn.Linear  # no oneDNN packing under compile

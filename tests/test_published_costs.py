"""The cost model (nanomm/emulate/costs.py) against published measurements, held here as data with their sources.

Three kinds of point:
- kernel sums: Vidur's profiled operator times (github.com/microsoft/vidur, data/profiling/compute/<gpu>/
  meta-llama/Llama-2-7b-hf/{mlp,attention}.csv, tensor parallel 1, the `time_stats.<op>.median` columns, in ms).
  A step's sum is what Vidur's ExecutionTime.model_time adds up: per layer attn_pre_proj + attn_post_proj +
  attn_rope + input_layernorm + post_attention_layernorm + mlp_up_proj + mlp_act + mlp_down_proj + add (mlp.csv,
  the row for the step's token count) + attn_decode or attn_prefill (attention.csv, the row for the batch and
  context), times 32 layers; no embedding, no LM head, no launch gaps or host work. They are compared with
  `CostModel.step_kernel_seconds` of the 32 decoder layers alone.
- a served step: vLLM's median TPOT, compared with `CostModel.step_seconds` (kernels + the host's floor).
- bounds: a measurement that covers more than the cost model prices (an HTTP front end, preprocessing, queueing
  inferred from a trace); the model's figure must not exceed it.
"""

from dataclasses import dataclass

import pytest

from nanomm.emulate import load_configs, model_shape
from nanomm.emulate.costs import GPUS, CostModel, ModelShape

VIDUR = "github.com/microsoft/vidur data/profiling/compute"
QUOTED = "vLLM PR #51349, as quoted in issue 65, not found in the stored threads"


@dataclass(frozen=True)
class Measurement:
    source: str
    gpu: str  # a key of GPUS
    model: str  # the hub id
    kind: str  # "decode kernels", "prefill kernels", "decode step", "prefill bound", "encode bound"
    shape: dict  # batch and context, prompt tokens, or the picture's pixels
    seconds: float
    note: str = ""


MEASUREMENTS = [
    # Llama-2-7B on H100: the linear and small ops (mlp.csv, rows num_tokens = 1, 8, 32, 128) sum to 5.600,
    # 5.504, 5.792 and 6.368 ms over 32 layers, checked here; attention.csv is stored as Git LFS and could not be
    # read, so the totals are issue 65's (their attention part, 0.4-21.4 ms, is the A100's below scaled by the
    # two HBMs' ratio, 1.64, within a few percent).
    *[Measurement(f"{VIDUR}/h100", "h100", "meta-llama/Llama-2-7b-hf", "decode kernels",
                  {"batch": batch, "context": 1024}, ms / 1e3, "linear ops checked, attention as quoted")
      for batch, ms in ((1, 6.0), (8, 7.9), (32, 12.1), (128, 27.8))],
    # Llama-2-7B on A100, summed here: mlp.csv's 9.280, 9.056, 9.536, 12.240 ms (32 layers) plus 32 x
    # attn_decode at kv_cache_size 1024 from attention.csv (Vidur's is Git LFS; read from the copy in
    # github.com/sw5sh/cs378-assignment3, same header and grid, not compared byte for byte): 0.020, 0.120,
    # 0.325, 1.098 ms; the file profiles context 1024 twice, and 8 and 32 take the two rows' mean (0.119/0.121,
    # 0.324/0.326).
    *[Measurement(f"{VIDUR}/a100", "a100", "meta-llama/Llama-2-7b-hf", "decode kernels",
                  {"batch": batch, "context": 1024}, ms / 1e3)
      for batch, ms in ((1, 9.920), (8, 12.896), (32, 19.936), (128, 47.376))],
    # prefill of one 512- and one 2,048-token prompt on H100: mlp.csv's part is 11.984 and 40.528 ms, checked;
    # the totals (with attn_prefill) are issue 65's.
    *[Measurement(f"{VIDUR}/h100", "h100", "meta-llama/Llama-2-7b-hf", "prefill kernels", {"tokens": tokens},
                  ms / 1e3, "linear ops checked, attention as quoted")
      for tokens, ms in ((512, 13.0), (2048, 48.3))],
    # vLLM serving Qwen2-VL-2B on an H800, one request at a time, about 768 prompt tokens
    Measurement(QUOTED, "h800", "Qwen/Qwen2-VL-2B-Instruct", "decode step", {"batch": 1, "context": 768}, 2.42e-3,
                "median TPOT"),
    # its median TTFT also holds the HTTP front end, tokenizing and whatever the prompt's pictures cost (the
    # stored threads do not say): a bound on one prefill step, not a point
    Measurement(QUOTED, "h800", "Qwen/Qwen2-VL-2B-Instruct", "prefill bound", {"tokens": 768}, 58.6e-3,
                "median TTFT"),
    # vLLM 0.19.1, Qwen2.5-VL-7B on an H100 80GB, one 1080p picture (resized to 1932 x 1092: 138 x 78 patches,
    # 2,691 visual tokens; the trace counts 2,718 prompt tokens): "time taken by encoder" 0.167 s, inferred as
    # the TTFT minus the traced prefill, so it holds the picture's preprocessing too: a bound, not a point
    Measurement("github.com/vllm-project/vllm/issues/41267", "h100", "Qwen/Qwen2.5-VL-7B-Instruct", "encode bound",
                {"width": 1932, "height": 1092}, 0.167, "TTFT minus prefill"),
]

WITHIN = 0.15  # a point's relative error


def decoder_layers_shape(hidden: int, layers: int, intermediate: int) -> ModelShape:
    """The decoder layers of a Llama-style model in bfloat16 with as many KV heads as query heads, and nothing
    else: what Vidur's sums time (no embedding, no head, no tower)."""
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden  # q k v o, gate up down, two norms
    params = layers * per_layer + hidden  # and the final norm
    return ModelShape(lm_params=params, lm_weight_bytes=2 * params, layers=layers, attention_width=hidden,
                      kv_bytes_per_token=2 * layers * hidden * 2, vision_params=0, vision_weight_bytes=0,
                      vision_depth=0, vision_width=0, vision_window_patches=0, vision_full_blocks=0,
                      visual_token_bytes=0)


def shape_of(model: str) -> ModelShape:
    if model == "meta-llama/Llama-2-7b-hf":  # its config.json: hidden 4096, 32 layers, intermediate 11008
        return decoder_layers_shape(hidden=4096, layers=32, intermediate=11008)
    if model == "Qwen/Qwen2-VL-2B-Instruct":
        return model_shape(load_configs("qwen2-vl-2b")[0])
    if model == "Qwen/Qwen2.5-VL-7B-Instruct":  # its tower is the 3B's (32 blocks, 1280 wide, windowed) but
        return model_shape(load_configs("qwen2.5-vl-3b")[0])  # for the merger's last layer (~1% of its weights)
    raise KeyError(model)


def predicted_seconds(m: Measurement) -> float:
    costs = CostModel(GPUS[m.gpu], shape_of(m.model))
    if m.kind == "decode kernels":
        return costs.step_kernel_seconds([(1, m.shape["context"])] * m.shape["batch"])
    if m.kind == "prefill kernels":
        return costs.step_kernel_seconds([(m.shape["tokens"], m.shape["tokens"])])
    if m.kind == "decode step":
        return costs.step_seconds([(1, m.shape["context"] + 1)] * m.shape["batch"])
    if m.kind == "prefill bound":
        return costs.step_seconds([(m.shape["tokens"], m.shape["tokens"])])
    if m.kind == "encode bound":
        patch = 14
        return costs.encode_seconds([(m.shape["width"] // patch) * (m.shape["height"] // patch)])
    raise KeyError(m.kind)


def label(m: Measurement) -> str:
    return f"{m.gpu}-{m.model.split('/')[1]}-{m.kind.replace(' ', '-')}-" + "-".join(map(str, m.shape.values()))


POINTS = [m for m in MEASUREMENTS if "bound" not in m.kind]
BOUNDS = [m for m in MEASUREMENTS if "bound" in m.kind]


@pytest.mark.parametrize("measurement", POINTS, ids=label)
def test_the_cost_model_is_within_15_percent_of_a_published_point(measurement):
    predicted = predicted_seconds(measurement)
    assert predicted == pytest.approx(measurement.seconds, rel=WITHIN), (
        f"{measurement.source}: measured {measurement.seconds * 1e3:.2f} ms, the model gives "
        f"{predicted * 1e3:.2f} ms ({predicted / measurement.seconds:.2f}x)")


@pytest.mark.parametrize("measurement", BOUNDS, ids=label)
def test_the_cost_model_stays_under_a_measurement_that_covers_more_than_it_prices(measurement):
    predicted = predicted_seconds(measurement)
    assert 0 < predicted <= measurement.seconds, (
        f"{measurement.source}: measured {measurement.seconds * 1e3:.1f} ms in all, the model gives "
        f"{predicted * 1e3:.1f} ms for its part alone")


def test_every_measurement_names_a_source_a_gpu_the_model_knows_and_a_positive_time():
    for m in MEASUREMENTS:
        assert m.source and m.gpu in GPUS and m.seconds > 0 and shape_of(m.model)

"""The cost model: how long a device takes for a step, an encode and a transfer, from FLOPs and bytes.

Lesson: lessons/13-three-topologies.md (the emulated device).

One module in plain Python (no torch), so that any tool can share its formulas; the emulated device
(emulate/runner.py) runs on it, and so does the topology simulator's engine-faithful mode
(nanomm/sim/twin.py, `nanomm-bench simulate --emulate`). Every figure is a roofline with a floor:

    step    = floor + layers x per-layer floor + max(FLOPs / (peak x compute_efficiency),
                                                     bytes / (bandwidth x bandwidth_efficiency))
    FLOPs   = 2 x LM parameters x tokens (the head's only for the rows that sample)
              + 4 x layers x attention width x sum over runs of new x mean context
    bytes   = LM weight bytes (read once a step) + sum over runs of context x KV bytes per token
    encode  = encode_floor + max(tower FLOPs / ..., tower weight bytes / ...), per batch of pictures
    tower   = 2 x vision parameters x patches + 4 x depth x vision width x patches x the patches each attends to
    link    = bytes / link bandwidth + link latency

The step's kernels (`step_kernel_seconds`) are the per-layer floor and the roofline; the floor is what a real
engine pays around them whatever the batch: launch gaps, the host's scheduling and sampling. Rooflines alone make
a 2B model on an H200 answer in microseconds; engines take milliseconds. Defaults, and where each comes from
(tests/test_published_costs.py holds the published points and checks every one within 15%):
- peak dense bf16 FLOP/s, HBM bytes/s and memory: the vendors' datasheets (GPUS);
- bandwidth 80% of peak: Vidur's profiled kernel sums of a Llama-2-7B decode step at context 1,024
  (microsoft/vidur data/profiling, TP1) need 0.78-0.82 on both H100 and A100 for batches 1 to 128 to come within
  15% together (H100's batch 128, where the KV reads dominate, needs at least 0.78; A100's batch 8 at most
  0.82); one figure for all sizes: the one 2B point below cannot tell a lower small-model efficiency from the floor;
- compute 55% of peak: the same profiles' H100 prefills of 512 and 2,048 tokens imply 0.55 and 0.59;
- per-layer floor 20 us: the small kernels a roofline does not see, in the same profiles (two RMSNorms, rotary,
  SiLU-and-mul and the residual add: 19 us a layer on H100, 24-31 us on A100, at 1-128 tokens);
- step floor 0.7 ms: what vLLM's median TPOT for Qwen2-VL-2B on an H800 at one request (2.42 ms, vLLM PR #51349
  as quoted in issue 65) leaves after the kernels above (1.72 ms): launch gaps and host work;
- the encode floor 1 ms: assumed; the one published tower time found (vLLM issue 41267: Qwen2.5-VL-7B, H100,
  1080p, 167 ms with preprocessing) only bounds the tower's 32 ms from above;
- a 200 Gb/s link (25 GB/s) with 50 us latency: a common datacenter NIC.
A cost file measured on a real GPU (`CostModel.with_cost_file`) replaces any of them.
"""

import json
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense, per second
    hbm_bytes_per_s: float
    memory_gib: float


GPUS = {  # FLOP/s and bytes/s: the vendors' datasheets (SXM parts); memory: the total nvidia-smi reports, in GiB
    "h100": Gpu("NVIDIA H100 SXM", 989e12, 3.35e12, 81559 / 1024),
    # the H800 is the H100 sold into China with a narrower NVLink (400 GB/s, not 900): the same FLOP/s and HBM
    "h800": Gpu("NVIDIA H800 SXM", 989e12, 3.35e12, 81559 / 1024),
    "h200": Gpu("NVIDIA H200 SXM", 989e12, 4.8e12, 143771 / 1024),  # nanomm's own H200 run (BENCHMARKS.md)
    "a100": Gpu("NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 81920 / 1024),
    "l4": Gpu("NVIDIA L4", 121e12, 300e9, 23034 / 1024),
}


@dataclass(frozen=True)
class ModelShape:
    """What the formulas need of a model: counts and widths (`emulate.model_shape` reads them off a config)."""
    lm_params: int
    lm_weight_bytes: int
    layers: int
    attention_width: int  # query heads x head_dim
    kv_bytes_per_token: int
    vision_params: int
    vision_weight_bytes: int
    vision_depth: int
    vision_width: int
    vision_window_patches: int  # patches a windowed block attends within (0: every block sees the whole image)
    vision_full_blocks: int  # blocks that attend over the whole image (all of them when not windowed)
    visual_token_bytes: int  # one visual token as it crosses to the language model
    lm_head_params: int = 0  # part of lm_params, multiplied only for the rows that sample (0: on every row)


@dataclass(frozen=True)
class Efficiency:
    compute: float = 0.55
    bandwidth: float = 0.8
    step_floor_s: float = 0.7e-3  # launch gaps and host work: not kernel time
    step_floor_per_layer_s: float = 20e-6  # each layer's small kernels: kernel time
    encode_floor_s: float = 1e-3
    link_bytes_per_s: float = 25e9
    link_latency_s: float = 50e-6


class CostModel:
    """Seconds for a step, an encode and a transfer of one model on one GPU."""

    def __init__(self, gpu: Gpu, shape: ModelShape, efficiency: Efficiency = Efficiency()):
        self.gpu, self.shape, self.efficiency = gpu, shape, efficiency

    def _roofline(self, flops: float, num_bytes: float) -> float:
        e = self.efficiency
        return max(flops / (self.gpu.bf16_flops * e.compute), num_bytes / (self.gpu.hbm_bytes_per_s * e.bandwidth))

    def step_seconds(self, runs: list[tuple[int, int]]) -> float:
        """One forward of the language model over runs of (new tokens, context length after them): a prompt
        chunk or a decode each, with the host's work around it. Nothing runs: no time."""
        if not runs:
            return 0.0
        return self.efficiency.step_floor_s + self.step_kernel_seconds(runs)

    def step_kernel_seconds(self, runs: list[tuple[int, int]]) -> float:
        """The GPU's kernels alone for that step: each layer's small kernels plus the roofline (what a
        profiler's kernel sum measures, without the launch gaps and the host's work)."""
        if not runs:
            return 0.0
        s = self.shape
        tokens = sum(new for new, _ in runs)
        sampled_rows = len(runs)  # a decode's token, or a prompt chunk's last row, goes through the LM head
        # each new token attends to its context: the run's new tokens see on average context - (new - 1) / 2 keys
        attended = sum(new * (context - (new - 1) / 2) for new, context in runs)
        body_params = s.lm_params - s.lm_head_params
        flops = (2 * body_params * tokens + 2 * s.lm_head_params * sampled_rows
                 + 4 * s.layers * s.attention_width * attended)
        num_bytes = s.lm_weight_bytes + sum(context for _, context in runs) * s.kv_bytes_per_token
        return self.efficiency.step_floor_per_layer_s * s.layers + self._roofline(flops, num_bytes)

    def encode_seconds(self, patches_per_image: list[int]) -> float:
        """One vision forward over pictures of these patch counts (before the 2x2 merge), batched."""
        if not patches_per_image:
            return 0.0
        s = self.shape
        window = s.vision_window_patches
        attended = 0.0
        for patches in patches_per_image:  # full-attention blocks see the image, windowed ones their window
            attended += patches * patches * s.vision_full_blocks
            attended += patches * min(window or patches, patches) * (s.vision_depth - s.vision_full_blocks)
        flops = 2 * s.vision_params * sum(patches_per_image) + 4 * s.vision_width * attended
        return self.efficiency.encode_floor_s + self._roofline(flops, s.vision_weight_bytes)

    def transfer_seconds(self, num_bytes: int) -> float:
        return num_bytes / self.efficiency.link_bytes_per_s + self.efficiency.link_latency_s

    # -- a cost file --------------------------------------------------------------------------------------------

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"gpu": asdict(self.gpu), "efficiency": asdict(self.efficiency)}, f, indent=2)

    def with_cost_file(self, path: str) -> "CostModel":
        """This model with the GPU figures and efficiencies of a cost file (e.g. measured on a real GPU): any
        field the file names replaces the default; an unknown one is an error."""
        with open(path) as f:
            values = json.load(f)
        unknown = set(values) - {"gpu", "efficiency"}
        gpu, efficiency = self.gpu, self.efficiency
        for name, current in (("gpu", gpu), ("efficiency", efficiency)):
            given = values.get(name, {})
            known = {f.name for f in fields(current)}
            unknown |= {f"{name}.{key}" for key in given if key not in known}
            if name == "gpu":
                gpu = replace(current, **{k: v for k, v in given.items() if k in known})
            else:
                efficiency = replace(current, **{k: float(v) for k, v in given.items() if k in known})
        if unknown:
            raise ValueError(f"cost file {path}: unknown fields {sorted(unknown)}")
        return CostModel(gpu, self.shape, efficiency)

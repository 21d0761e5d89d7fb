"""The CPU fast path against plain F.linear, shape by shape: what nanomm/accel/packed_linear.py buys on this CPU.

    python scripts/bench_linear.py              # the `small` preset's shapes, 2 threads, best of 20
    python scripts/bench_linear.py --threads 4 --repeats 50
    python scripts/bench_linear.py --head-rows 1 8 32 64 128   # the LM head alone at other batch sizes
    python scripts/bench_linear.py --layer-sweep --repeats 5   # small layers: where packing starts to pay
    python scripts/bench_linear.py --inductor-head --repeats 5  # the 32-row head: Inductor's own GEMM kernels too

Prints one line per shape: F.linear ms, PackedLinear ms and the speed-up. Results go in BENCHMARKS.md with the
machine (`lscpu`): the answer differs between CPUs (oneDNN's packed kernel doubles the matmul rate on an AMD
EPYC where MKL is slow, and is roughly even with it on an Intel Xeon). Nothing here is a test.
"""

import argparse
import platform
import sys
import time


import torch
import torch.nn.functional as F

from nanomm.accel.packed_linear import PackedLinear, packed_linear_available

SHAPES = [  # (rows, in, out): the `small` preset's layers at decode and prefill sizes
    (32, 512, 151_936, "LM head, batch-32 decode"),
    (1, 512, 151_936, "LM head, batch-1 decode"),
    (32, 512, 1_376, "MLP, batch-32 decode"),
    (2048, 512, 512, "attention projection, prefill chunk"),
    (2048, 2048, 2048, "square"),
]


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--layer-sweep", action="store_true",
                   help="also time layers from 256 to 1,536 wide at 1, 5 and 32 rows (where packing starts to pay)")
    p.add_argument("--head-rows", type=int, nargs="*", default=[],
                   help="also time the LM head (512 x 151,936, packed as the engine packs it) at these row counts")
    p.add_argument("--inductor-head", action="store_true",
                   help="also time the 32-row LM head compiled by Inductor with max-autotune (its C++ GEMM template "
                        "against ATen's kernels; it prints which it picked)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not packed_linear_available(torch.device("cpu"), torch.float32):
        sys.exit("this torch build has no usable oneDNN linear ops: nanomm stays on F.linear here")
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads")
    with torch.inference_mode():
        for rows, d_in, d_out, what in SHAPES:
            layer = torch.nn.Linear(d_in, d_out, bias=False)
            x = torch.randn(rows, d_in)
            packed = PackedLinear(layer, batch_size_hint=rows)
            plain_ms = best_ms(lambda: F.linear(x, layer.weight), args.repeats)
            packed_ms = best_ms(lambda: packed(x), args.repeats)
            print(f"{rows} x {d_in} @ {d_in} x {d_out} ({what}): F.linear {plain_ms:.2f} ms, "
                  f"packed {packed_ms:.2f} ms, {plain_ms / packed_ms:.2f}x, packed {gflops(rows, d_in, d_out, packed_ms)}")
        head_at_rows(args.head_rows, args.repeats)
        if args.layer_sweep:
            layer_sweep(args.repeats)
    if args.inductor_head:
        inductor_head(args.repeats)


def gflops(rows: int, d_in: int, d_out: int, ms: float) -> str:
    return f"{2 * rows * d_in * d_out / ms / 1e6:.0f} GFLOP/s"


SWEEP_LAYERS = [(256, 768), (256, 1024), (512, 256), (256, 619), (512, 512), (512, 768), (1536, 512), (512, 3072),
                (1536, 2048)]  # (in, out): the demo model's layers, then the `small` and `2b-shaped` presets'


def layer_sweep(repeats: int) -> None:
    """Each layer of SWEEP_LAYERS at 1, 5 and 32 rows, F.linear against packed, in microseconds per call (each
    the best of `repeats` means of 200 calls: these calls are too short to time one by one)."""
    for d_in, d_out in SWEEP_LAYERS:
        layer = torch.nn.Linear(d_in, d_out, bias=False)
        packed = PackedLinear(layer)  # packed as the engine packs it (batch_size_hint 32)
        cells = []
        for rows in (1, 5, 32):
            x = torch.randn(rows, d_in)
            plain_us, packed_us = (best_ms(lambda: [f(x) for _ in range(200)], repeats) * 5 for f in (layer, packed))
            cells.append(f"{rows} rows: F.linear {plain_us:.0f} us, packed {packed_us:.0f} us")
        print(f"{d_in} -> {d_out}: " + "; ".join(cells))


def head_at_rows(row_counts: list[int], repeats: int) -> None:
    """The batch-32 decode step's largest matmul at other row counts: how close a matmul this skinny (few rows
    against 151,936 output columns) comes to the square one's rate."""
    layer = torch.nn.Linear(512, 151_936, bias=False)
    packed = PackedLinear(layer)  # packed as the engine packs it (batch_size_hint 32)
    for rows in row_counts:
        x = torch.randn(rows, 512)
        ms = best_ms(lambda: packed(x), repeats)
        print(f"LM head at {rows} rows: packed {ms:.2f} ms, {gflops(rows, 512, 151_936, ms)}")


def inductor_head(repeats: int) -> None:
    """The 32-row LM head through torch.compile(mode="max-autotune") with frozen weights: Inductor benchmarks its
    C++ micro-GEMM template against ATen's kernels and keeps the faster. Times it beside F.linear and packed."""
    import torch._inductor.config as inductor_config
    inductor_config.freezing = True  # the weight is a constant: Inductor may pre-pack it
    inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
    layer = torch.nn.Linear(512, 151_936, bias=False).eval()
    packed = PackedLinear(layer)
    x = torch.randn(32, 512)
    with torch.no_grad():  # freezing applies under no_grad, not inference_mode
        compiled = torch.compile(layer, mode="max-autotune")
        max_diff = (compiled(x) - F.linear(x, layer.weight)).abs().max().item()
        for _ in range(3):  # interleaved rounds: the machine's noise shows in all three columns alike
            plain_ms, packed_ms, compiled_ms = (best_ms(lambda: f(x), repeats)
                                                for f in (lambda v: F.linear(v, layer.weight), packed, compiled))
            print(f"LM head at 32 rows: F.linear {plain_ms:.2f} ms, packed {packed_ms:.2f} ms, "
                  f"Inductor max-autotune {compiled_ms:.2f} ms ({gflops(32, 512, 151_936, compiled_ms)}; "
                  f"largest difference from F.linear {max_diff:.1e})")


if __name__ == "__main__":
    main()

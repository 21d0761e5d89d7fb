"""The machine every benchmark figure is recorded with, and its roofline: the CPU or GPU by name, memory, versions,
a best-of timer, and the bandwidth and matmul rate this machine reaches.

Lesson: lessons/09-bytes-per-step.md (the roofline) and lessons/A3-cpu-kernels.md.
"""

import math
import os
import platform
import time
from importlib import metadata
from pathlib import Path

import torch

from nanomm.accel.packed_linear import PackedLinear, packed_linear_available

try:
    import resource  # page faults and system time of a run (Unix)
except ImportError:
    resource = None


def _version_of(package: str) -> str | None:
    """An installed package's version, or None: transformers is a test tool, not everyone has it."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo on Linux), which every benchmark figure is recorded with."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    cpu = cpu_name()
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    return dict(cpu=cpu, logical_cores=os.cpu_count(),
                usable_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                memory_gib=round(mem_gib, 1) if mem_gib else None, load_avg=list(os.getloadavg()),
                python=platform.python_version(), torch=torch.__version__, transformers=_version_of("transformers"),
                torch_threads=torch.get_num_threads(), torch_interop_threads=torch.get_num_interop_threads(),
                cuda=torch.cuda.is_available(),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


def synchronize(device: torch.device) -> None:
    """Wait for the device: on a GPU, work is queued and a timer around a launch measures only the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, repeats: int, device: torch.device = torch.device("cpu")) -> float:
    fn()  # warm-up: page faults, thread pool start
    synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_roofline(bw_mib: int, matmul_n: int, repeats: int, device: torch.device = torch.device("cpu"),
                     dtype: torch.dtype = torch.float32) -> dict:
    """Memory bandwidth and matmul rate with torch and the same thread count as the engines.

    Read bandwidth: x.sum() over a tensor much larger than the caches reads every byte once and does one add
    per 4 bytes, far below the vector units' rate, so it is limited by DRAM; decode reads weights the same way.
    Copy bandwidth (read + write) is reported too, for reference. Matmul: an n x n @ n x n float32 product,
    2 n^3 FLOPs, timed with torch.mm (MKL) and, on CPU, with the oneDNN packed kernel nanomm's linear layers
    use (nanomm/accel/packed_linear.py); the machine's rate is the faster of the two, so neither engine is measured
    against a roof its own library could beat. On a GPU the same, in the run's dtype (cuBLAS only)."""
    n = bw_mib * 2**20 // 4
    x, y = torch.ones(n, device=device), torch.empty(n, device=device)
    read_s = best_time(lambda: x.sum(), repeats, device)
    copy_s = best_time(lambda: y.copy_(x), repeats, device)
    a, b, c = (torch.randn(matmul_n, matmul_n, device=device, dtype=dtype) for _ in range(3))
    mm_s = best_time(lambda: torch.mm(a, b, out=c), repeats, device)
    packed_s = math.inf
    if packed_linear_available(device, dtype):
        layer = torch.nn.Linear(matmul_n, matmul_n, bias=False)
        layer.weight.data = b
        packed = PackedLinear(layer, batch_size_hint=matmul_n)
        packed_s = best_time(lambda: packed(a), repeats)
    del x, y, a, b, c
    return dict(read_gbps=n * 4 / read_s / 1e9, copy_gbps=2 * n * 4 / copy_s / 1e9,
                matmul_gflops=2 * matmul_n**3 / min(mm_s, packed_s) / 1e9,
                mkl_matmul_gflops=2 * matmul_n**3 / mm_s / 1e9,
                onednn_matmul_gflops=2 * matmul_n**3 / packed_s / 1e9 if packed_s < math.inf else None,
                bw_tensor_mib=bw_mib, matmul_n=matmul_n, repeats=repeats)


def process_usage() -> dict:
    """Minor page faults and CPU seconds (user, system) of this whole process so far; NaNs where there is no
    `resource` (not Unix)."""
    if resource is None:
        return dict(page_faults=math.nan, user_s=math.nan, system_s=math.nan)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return dict(page_faults=usage.ru_minflt, user_s=usage.ru_utime, system_s=usage.ru_stime)


def usage_since(before: dict) -> dict:
    """process_usage() now, less `before`."""
    return {key: value - before[key] for key, value in process_usage().items()}


def add_device_args(parser) -> None:
    """--device and --dtype, the same in every bench script: where the engines run, and in what."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the engines run")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="weights and activations")


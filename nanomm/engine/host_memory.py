"""Keep freed host memory mapped, so that a CPU engine's big temporaries stop costing page faults every step.

Lesson: lessons/05-continuous-batching.md, section 6 (what a CPU step spends its time on).

PyTorch's CPU tensors come from glibc's malloc, which makes two choices a serving loop pays for:

- an allocation above `M_MMAP_THRESHOLD` (a dynamic value, 128 KiB to 32 MiB) gets pages of its own from the
  kernel, and gives them back when it is freed;
- free memory at the top of the heap beyond `M_TRIM_THRESHOLD` is given back too.

Each page given back and asked for again costs a page fault on first touch, about 4 KiB at a time. A prefill
chunk's temporaries (its MLP's intermediate, its logits, the vision tower's activations) are tens of megabytes
and are freed at the end of every step, so each chunk touched fresh memory again: on the 2-core development
VM a 2,048-token prefill chunk of the `2b-shaped` preset took 50,000-100,000 faults and 1.6-4 s of system time
(BENCHMARKS.md, "Page faults").

`keep_freed_memory` fixes both thresholds: allocations up to 32 MiB (the most glibc allows) come from the heap,
and the heap is never trimmed. Once the largest step has run, later steps reuse the same pages. The cost is
that the process keeps its peak resident memory, which a server wants anyway. The setting is per process (it
changes malloc for everything in it, as `LD_PRELOAD`-ing another allocator would); it is applied once, by the
first CPU `LLM`, and can be turned off with `LLM(cpu_keep_freed_memory=False)`. Elsewhere (not glibc, or a
GPU, whose caching allocator already keeps its memory) it does nothing.
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
LARGEST_MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more (half its arena heap size on 64-bit systems)
NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse (module docstring). True if it took the settings."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        libc = ctypes.CDLL(libc_name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))

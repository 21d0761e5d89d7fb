"""engine/host_memory.py: with glibc told to keep freed memory, a step's temporaries stop re-faulting their pages.

The setting is per process, so each case runs in a fresh interpreter and reports its page faults."""

import json
import platform
import subprocess
import sys

import pytest

ROUNDS = """
import json, resource, sys, torch
from nanomm.engine.host_memory import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(5):  # a "step": eight 8 MiB temporaries (each under glibc's 32 MiB limit) made, touched, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    temporaries = [torch.ones(2 * 2**20) for _ in range(8)]
    del temporaries
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"took": took, "faults": faults}))
"""


def _rounds(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="mallopt's thresholds are glibc's")
def test_kept_memory_is_reused_without_page_faults():
    default, kept = _rounds("default"), _rounds("keep")
    assert kept["took"] is True
    pages = 8 * 8 * 2**20 // 4096  # 16,384 pages of 4 KiB in a round
    # By default glibc trims the freed 64 MiB off the heap's top after each round: every round faults it back.
    assert all(f > pages // 2 for f in default["faults"][1:]), default
    # Kept: the first round faults the pages in once, later rounds reuse them (measured: 0 in most rounds, one
    # 8 MiB tensor's 2,048 pages now and then, as the freed chunks are handed out in another order).
    assert kept["faults"][0] > pages // 2, kept
    assert all(f <= pages // 4 for f in kept["faults"][1:]) and sum(kept["faults"][1:]) < pages // 2, kept


def test_keep_freed_memory_is_an_engine_switch():
    from nanomm.engine.config import EngineConfig
    assert EngineConfig().cpu_keep_freed_memory is True
    with pytest.raises(ValueError, match="cpu_keep_freed_memory must be True or False"):
        EngineConfig(cpu_keep_freed_memory="yes")

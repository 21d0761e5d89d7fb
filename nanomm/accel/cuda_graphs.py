"""Moved to nanomm/engine/cuda_graphs.py: CUDA graphs run engine steps, and accel/ sits below the engine.

engine/engine.py imports `DecodeGraphs` from here until its rewrite names the new place; then this alias goes
(tests/test_layout.py's PENDING_ALIASES lists it, and checks that it holds nothing else).
"""

from nanomm.engine.cuda_graphs import DecodeGraphs  # noqa: F401

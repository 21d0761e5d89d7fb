"""The serving engine: requests, the scheduler, the paged KV cache, the encoder cache, one model step, speculation.

Read in this order: `request.py` (a request's state), `kv_cache.py` and `attention.py` (lesson 04), `sizing.py`
(how big the KV pool and the budgets are, lesson 04), `scheduler.py` (lesson 05), `encoder_cache.py` (lesson 07),
`model_runner.py`, `speculative.py` and `draft.py` (lesson 08), then `engine.py`, which ties them into
`add_request` / `step`. Its fast paths that run engine steps are here too: `cuda_graphs.py` (decode steps
recorded once and replayed with one launch; `enforce_eager=True` turns it off, and on a CPU the same static path
runs unrecorded, tests/test_cuda_graphs.py) and `memory_profile.py` (on a GPU, the activation reserve measured by
running the engine's largest steps once, which sizing.py leaves out of the KV pool). The model's speed-ups, and
the batched attention, sit below in accel/ (appendix A3).
"""

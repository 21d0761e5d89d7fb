"""The serving engine: requests, the scheduler, the paged KV cache, the encoder cache, one model step, speculation.

Read in this order: `request.py` (a request's state), `kv_cache.py` and `attention.py` (lesson 04), `sizing.py`
(how big the KV pool and the budgets are, lesson 04), `scheduler.py` (lesson 05), `encoder_cache.py` (lesson 07),
`model_runner.py`, `speculative.py` and `draft.py` (lesson 08), then `engine.py`, which ties them into
`add_request` / `step`. The engine's fast paths (the batched decode attention, CUDA graphs, the GPU memory
profile) live behind the accel/ seam, with the model's (appendix A3).
"""

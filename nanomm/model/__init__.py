"""Qwen2-VL in plain PyTorch: its config, its weights, the vision tower, the decoder and their rotary positions.

`config.py` parses config.json, `loader.py` reads safetensors, `vision.py` is the ViT and projector (lesson 02),
`rope.py` the 1-D, 2-D and M-RoPE positions (lesson 03), `attention.py` one sequence's causal attention and the
backend interface (lesson 04), `qwen2.py` the decoder and `qwen2_vl.py` joins them; `fp8.py` holds the fp8 KV
cache's numerics, which the dense reference shares. This is the architecture as transformers computes it: every
speed-up is swapped in from nanomm/accel/ after loading.
"""

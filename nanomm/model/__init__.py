"""Qwen2-VL in plain PyTorch: its config, its weights, the vision tower, the decoder and their rotary positions.

`config.py` parses config.json, `loader.py` reads safetensors, `vision.py` is the ViT and projector (lesson 02),
`rope.py` the 1-D, 2-D and M-RoPE positions (lesson 03), `qwen2.py` the decoder and `qwen2_vl.py` joins them.
`fast_linear.py` is an optional CPU fast path and `compile.py` the optional `torch.compile` path, neither part
of the model's definition.
"""

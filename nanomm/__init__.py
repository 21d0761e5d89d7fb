"""nanomm: a small, readable, exact reference engine for serving multimodal LLMs (Qwen2-VL), in pure PyTorch.

Start with lessons/README.md. The public API is re-exported here.
"""

from nanomm.demo import demo_checkpoint
from nanomm.engine.engine import LLMEngine
from nanomm.errors import CheckpointError, InvalidInputError
from nanomm.llm import LLM
from nanomm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanomm.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "InvalidInputError", "CheckpointError", "demo_checkpoint"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "StructuredOutputsParams":  # loaded on first use (nanomm/structured_params.py)
        from nanomm.structured_params import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Parallel sampling: `SamplingParams(n=k)` asks for k completions of one prompt, and the prompt runs once.

Lesson: lessons/06-prefix-caching.md (the children share the prompt's KV blocks through the prefix cache).

The engine turns such a request into k child requests, `"{i}_{request_id}"` (vLLM's naming), each an ordinary
request with n = 1 and its own generator (seed + i when a seed is given, as in vLLM). The first child prefills the
prompt; the others wait in the queue until its prompt KV is computed and its full blocks are named in the prefix
cache, then start with those blocks as cache hits: only the last, partial block is computed again (every
sequence computes its last prompt token, whose logits pick its first output). Images are encoded once too: the
children share the encoder-cache entries. With prefix caching off, every child prefills on its own, as in vLLM.

`ParentRequest` merges the children's outputs back into one `RequestOutput` whose `outputs` holds every
completion, in index order.
"""

from dataclasses import replace

from nanomm.outputs import RequestOutput
from nanomm.sampling import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child i samples alone (n = 1), with seed + i so that the k completions differ yet repeat run to run."""
    return replace(params, n=1, seed=None if params.seed is None else params.seed + index)


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [f"{i}_{request_id}" for i in range(n)]


class ParentRequest:
    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.child_ids = child_request_ids(request_id, n)
        self.latest = {}  # completion index -> its latest CompletionOutput
        self.finished: set[int] = set()
        self.device_s = {}  # completion index -> its child's device seconds so far

    def merge(self, outputs: list[RequestOutput]) -> RequestOutput:
        """This step's outputs of some children -> one output for the parent: each child's latest completion
        (cumulative); the ones that did not advance this step carry empty deltas."""
        for out in outputs:
            self.latest[out.outputs[0].index] = out.outputs[0]
            self.device_s[out.outputs[0].index] = out.metrics.device_s
            if out.finished:
                self.finished.add(out.outputs[0].index)
        advanced = {out.outputs[0].index for out in outputs}
        completions = [c if i in advanced else replace(c, delta_token_ids=[], delta_text="")
                       for i, c in sorted(self.latest.items())]
        first = outputs[0]
        metrics = replace(first.metrics, device_s=sum(self.device_s.values()))  # every child's device time
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, completions,
                             self.done, metrics, first.prompt_logprobs)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.child_ids)

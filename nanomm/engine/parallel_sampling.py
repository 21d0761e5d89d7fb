"""Parallel sampling: `SamplingParams(n=k)` asks for k completions of one prompt, and the prompt runs once.

Lesson: lessons/06-prefix-caching.md (the children share the prompt's KV blocks through the prefix cache).

The engine turns such a request into k child requests, `"{i}_{request_id}"` (vLLM's naming), each an ordinary
request with n = 1 and its own generator (seed + i when a seed is given, as in vLLM). The first child prefills the
prompt; the others wait in the queue until its prompt KV is computed and its full blocks are named in the prefix
cache, then start with those blocks as cache hits: only the last, partial block is computed again (every
sequence computes its last prompt token, whose logits pick its first output). Images are encoded once too: the
children share the encoder-cache entries. With prefix caching off, every child prefills on its own, as in vLLM.

`ParentRequest` merges the children's outputs back into one `RequestOutput` whose `outputs` holds every
completion, in index order. `ParallelSampling` is the engine's part that keeps the parents (engine.py makes one
when the first request with n > 1 comes): it makes the children, merges their outputs, and forgets or aborts them
with their parent.
"""

from dataclasses import replace

from nanomm.errors import InvalidInputError
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


class ParallelSampling:
    """The engine's requests with n > 1, each parent by its id and its children's."""

    def __init__(self):
        self.parents: dict[str, ParentRequest] = {}

    def holds(self, request_id: str, preprocessing: dict) -> bool:
        """A parent's or a child's id, or a child id of a request with n > 1 still preprocessing (its children get
        their ids only once admitted, so it reserves them). preprocessing: the intake's, id -> (_, params, _)."""
        if request_id in self.parents:
            return True
        return any(request_id in child_request_ids(parent_id, params.n)
                   for parent_id, (_, params, _) in preprocessing.items() if params.n > 1)

    def check_child_ids(self, request_id: str, n: int, id_in_use) -> None:
        child_ids = child_request_ids(request_id, n)
        if any(map(id_in_use, child_ids)):
            raise InvalidInputError(f"request {request_id}: with n={n} its completions are requests {child_ids}, "
                                    "and one of those ids is in use")

    def children(self, request_id: str, params: SamplingParams, make_child, share_prefill: bool) -> list:
        """The parent's n requests, make_child(child_id, child_params, index) each. share_prefill (prefix caching
        on): the first child prefills, the others wait to find its blocks cached (not with prompt logprobs)."""
        parent = ParentRequest(request_id, params.n)
        self.parents[request_id] = parent
        children, leader = [], None
        for i, child_id in enumerate(parent.child_ids):
            child = make_child(child_id, child_params(params, i), i)
            if share_prefill and child.params.prompt_logprobs is None:
                child.waits_for_prefill_of = leader
            self.parents[child_id] = parent
            children.append(child)
            leader = leader or child
        return children

    def children_of(self, request_id: str) -> list[str]:
        """The child ids of a parent; [] for any other id."""
        parent = self.parents.get(request_id)
        return parent.child_ids if parent is not None and parent.request_id == request_id else []

    def forget(self, request_ids: list[str]) -> list[str]:
        """Forget these requests and the children of those that are parents; the children's ids."""
        children = [c for r in request_ids if r in self.parents for c in self.parents[r].child_ids]
        for request_id in request_ids + children:
            self.parents.pop(request_id, None)
        return children

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's outputs, with the children's merged into one output per parent, in the first one's place."""
        merged, by_parent = [], {}
        for out in outputs:
            parent = self.parents.get(out.request_id)
            if parent is None:
                merged.append(out)
            elif parent.request_id not in by_parent:
                by_parent[parent.request_id] = [out]
                merged.append(parent)  # its place in the list, filled below
            else:
                by_parent[parent.request_id].append(out)
        for i, item in enumerate(merged):
            if isinstance(item, ParentRequest):
                merged[i] = item.merge(by_parent[item.request_id])
                if item.done:
                    for key in [item.request_id, *item.child_ids]:
                        self.parents.pop(key, None)
        return merged

"""One step's sampling: the tokens each chunk emits, its speculative proposals verified, from one read-back.

Lessons: lessons/05-continuous-batching.md (a step's sampling) and lessons/08-speculative-decoding.md
(verification). The rules that keep a sampled proposal exact are speculative.py's; the logits' adjustments and
draws are sampling.py's.
"""

from dataclasses import dataclass

import torch

from nanomm.engine.request import Request
from nanomm.sampling import adjust_logits, draw_tokens, greedy_tokens, next_uniform, probabilities, top_logprobs


def accept_greedy(proposed: list[int], target_argmax: list[int]) -> list[int]:
    """target_argmax[i] is the target's choice after the i-th proposal (len(proposed) + 1 rows). Emit the
    proposals up to the first disagreement, then the target's own token there (or the bonus after them all)."""
    emitted = []
    for token, target in zip(proposed, target_argmax):
        if token != target:
            break
        emitted.append(token)
    emitted.append(target_argmax[len(emitted)])
    return emitted


@dataclass
class SampledTokens:
    """What one sampling chunk adds to its request this step."""
    token_ids: list[int]  # the accepted proposals, then the target's own token
    num_accepted: int  # how many of token_ids were proposals
    logprobs: list[dict] | None = None  # per token, {token id: (logprob, rank)} when the request asked for them


def sample_and_verify(chunks, logits: torch.Tensor) -> list[SampledTokens]:
    """The tokens each sampling chunk emits, in order. logits (rows, vocab): 1 + len(spec_token_ids) rows per
    chunk, the row after each known token and after each proposal. Without proposals this is plain sampling;
    with them, speculative.py's acceptance rules. Greedy rows share one argmax; plain sampled rows that share their
    settings are drawn together (`draw_plain`), each with its own request's generator, and read back once per
    step. Penalties and min_tokens see, at each row, the output so far plus the proposals before it: the
    history that row would have in plain decoding. A constrained request's rows are masked by its grammar first
    (structured.py): its logprobs are those of the masked logits, as vLLM's."""
    greedy = any(c.request.params.greedy and not c.request.params.reads_history for c in chunks)
    argmax = greedy_tokens(logits).tolist() if greedy else []  # read back only when a greedy row takes it
    per_chunk, plain, row = [], {}, 0  # per chunk: (its first row, its tokens or None while drawn in a group)
    masked = {}  # chunk index -> its rows masked by its grammar
    for chunk in chunks:
        request, proposed = chunk.request, chunk.spec_token_ids
        rows = 1 + len(proposed)
        constrained = request.grammar is not None
        raw = logits[row:row + rows] if proposed or request.params.reads_history or constrained else None
        if constrained:  # (rows, vocab) with the tokens that would leave the grammar at -inf
            raw = masked[len(per_chunk)] = request.grammar.mask(raw, proposed)
        adjusted = adjusted_rows(request, proposed, raw) if request.params.reads_history else None
        adjusted = raw if constrained and adjusted is None else adjusted
        if request.params.greedy:
            chosen = adjusted.argmax(dim=-1).tolist() if adjusted is not None else argmax[row:row + rows]
            tokens = accept_greedy(proposed, chosen)
        elif not proposed:  # plain sampling: the same draw as accept_sampled's, made with its group's
            plain.setdefault(_settings(request.params), (request.params, []))[1].append(
                (len(per_chunk), request.generator, row if adjusted is None else adjusted[0]))
            tokens = None
        else:
            from nanomm.engine.speculative import accept_sampled  # proposals: speculation is on

            p = probabilities(raw if adjusted is None else adjusted, request.params)  # (rows, vocab)
            q = None if request.spec_token_probs is None else request.spec_token_probs[:rows - 1]
            tokens = accept_sampled(proposed, p, q, request.generator)
        per_chunk.append((row, tokens))
        row += rows
    drawn = draw_plain(plain, logits)  # the step's one read-back of sampled tokens
    emitted = []
    for i, (chunk, (row, tokens)) in enumerate(zip(chunks, per_chunk)):
        tokens = [drawn[i]] if tokens is None else tokens
        num_top = chunk.request.params.logprobs
        rows = masked[i][:len(tokens)] if i in masked else logits[row:row + len(tokens)]
        logprobs = None if num_top is None else top_logprobs(rows, tokens, num_top)
        emitted.append(SampledTokens(tokens, len(tokens) - 1, logprobs))  # every token but the last was a proposal
    return emitted


def _settings(params) -> tuple:
    """What `probabilities` reads of a request's parameters: rows that agree on it share one call."""
    return params.temperature, params.min_p, params.top_k, params.top_p


def draw_plain(groups: dict, logits: torch.Tensor) -> dict[int, int]:
    """Plain sampled rows, by settings: {settings: (the parameters, [(chunk index, generator, its logits row's
    index, or its adjusted logits (vocab,))])}. One `probabilities` and one `draw_tokens` per group, each row
    with its generator's next number; then every token read back at once. Returns {chunk index: token}."""
    order, draws = [], []
    for params, entries in groups.values():
        rows = [r for _, _, r in entries]
        if all(isinstance(r, int) for r in rows):
            picked = logits.index_select(0, torch.tensor(rows, device=logits.device))  # (group rows, vocab)
        else:
            picked = torch.stack([logits[r] if isinstance(r, int) else r for r in rows])
        uniforms = torch.tensor([next_uniform(generator) for _, generator, _ in entries], device=logits.device)
        draws.append(draw_tokens(probabilities(picked, params), uniforms))
        order += [i for i, _, _ in entries]
    return dict(zip(order, torch.cat(draws).tolist())) if draws else {}


def adjusted_rows(request: Request, proposed: list[int], raw: torch.Tensor) -> torch.Tensor:
    """`adjust_logits` for each verification row: row i follows the output and the first i proposals."""
    prompt, output = request.prompt.token_ids, request.output_token_ids
    return torch.stack([adjust_logits(raw[i], request.params, prompt, output + proposed[:i], request.stop_token_ids)
                        for i in range(raw.shape[0])])

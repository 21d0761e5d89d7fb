"""SamplingParams validation and the sampler's filters (top-k / top-p checked against transformers' warpers)."""

import pytest
import torch

from nanomm import InvalidInputError, SamplingParams
from nanomm.sampling import filter_logits, sample
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature="hot"),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(top_k=2.5),
    dict(max_tokens=0), dict(max_tokens=True), dict(stop_token_ids=[-1]), dict(stop_token_ids="12"),
    dict(ignore_eos="yes"), dict(seed=1.5),
])
def test_bad_sampling_params_raise(bad):
    field = next(iter(bad))
    with pytest.raises(InvalidInputError, match=field):
        SamplingParams(**bad)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.9), (0, 0.3), (20, 0.7), (1, 1.0)])
def test_filters_match_transformers(seed, top_k, top_p):
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(seed)) * 3
    expected = logits
    if top_k > 0:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = filter_logits(logits[0], top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected[0]))


def test_greedy_is_argmax_and_consumes_no_randomness():
    logits = torch.randn(50)
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    assert sample(logits, SamplingParams(temperature=0), generator) == int(logits.argmax())
    assert torch.equal(generator.get_state(), state)


def test_seeded_sampling_reproduces_and_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=1.0, seed=3)

    def draw(n):
        generator = torch.Generator().manual_seed(params.seed)
        return [sample(logits, params, generator) for _ in range(n)]

    first = draw(4000)
    assert first == draw(4000)
    freq = torch.bincount(torch.tensor(first), minlength=4).float() / len(first)
    assert (freq - torch.softmax(logits, -1)).abs().max() < 0.03

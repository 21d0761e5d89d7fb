"""SamplingParams validation and the sampler (top-k / top-p / temperature checked against transformers' warpers).

The oracle for the sampled distribution is built from transformers' own logits processors, applied in the order
transformers' generate() applies them: temperature, then top-k, then top-p, then softmax. It shares no code with
nanomm.sampling, so a temperature applied the wrong way round or the filters applied in the wrong order fail here.
"""

import math

import pytest
import torch

from nanomm import InvalidInputError, SamplingParams
from nanomm.sampling import draw_tokens, filter_logits, probabilities, sample
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


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


def test_inverse_cdf_draws_never_pick_a_token_of_probability_zero():
    """The extreme uniforms land on the first and the last token the row can draw, never on a masked one."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.5, 0.0, 0.0, 0.0, 0.5]])
    for uniform, expected in ((0.0, [1, 0]), (1 - 2 ** -24, [3, 4]), (0.25, [3, 0]), (0.2499, [1, 0])):
        assert draw_tokens(probs, torch.full((2,), uniform)).tolist() == expected


def test_a_row_draws_the_same_token_alone_and_in_a_batch():
    probs = torch.softmax(torch.randn(16, 300, generator=torch.Generator().manual_seed(1)), dim=-1)
    uniforms = torch.rand(16, generator=torch.Generator().manual_seed(2))
    batched = draw_tokens(probs, uniforms)
    assert batched.tolist() == [int(draw_tokens(probs[i:i + 1], uniforms[i:i + 1])) for i in range(16)]


def oracle_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers in transformers' order -> softmax. logits (..., vocab) -> probabilities (..., vocab)."""
    scores = logits.reshape(-1, logits.shape[-1])  # TopPLogitsWarper scatters along dim 1: it wants (batch, vocab)
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).reshape(logits.shape)


def assert_matches_oracle(logits, temperature, top_k, top_p):
    got = probabilities(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    expected = oracle_probabilities(logits, temperature, top_k, top_p)
    assert got.shape == logits.shape
    assert torch.equal(got > 0, expected > 0), "the support (which tokens can be drawn) differs from transformers'"
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


ORACLE_TEMPERATURES = [0.3, 0.7, 1.5]
ORACLE_FILTERS = [(0, 1.0), (5, 1.0), (0, 0.9), (20, 0.7), (3, 0.5)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("top_k,top_p", ORACLE_FILTERS)
@pytest.mark.parametrize("temperature", ORACLE_TEMPERATURES)
def test_probabilities_match_transformers_warpers(temperature, top_k, top_p, seed):
    # randn * 3 over 1000 tokens: peaked enough that the top-p nucleus is a handful of tokens, not most of the vocab.
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(seed)) * 3
    assert_matches_oracle(logits, temperature, top_k, top_p)


@pytest.mark.parametrize("shape", [(4, 1000), (2, 3, 1000)])
@pytest.mark.parametrize("top_k,top_p", ORACLE_FILTERS)
@pytest.mark.parametrize("temperature", ORACLE_TEMPERATURES)
def test_batched_probabilities_match_transformers_warpers(temperature, top_k, top_p, shape):
    # Every row is filtered and normalized on its own (..., vocab).
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(100)) * 3
    assert_matches_oracle(logits, temperature, top_k, top_p)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit of counts against probs; cells with expected count < 5 are pooled.

    The p-value is the chi-square survival function, Q(df/2, stat/2) (regularized upper incomplete gamma)."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    expected = probs * n
    # A draw where the distribution has no mass is impossible: fail outright rather than hide it in a pooled cell.
    assert counts[expected == 0].sum() == 0, "a token with probability 0 was drawn"
    counts, expected = counts[expected > 0], expected[expected > 0]
    order = torch.argsort(expected)
    counts, expected = counts[order], expected[order]
    small = int((expected < 5).sum())
    if small:
        # Pool the small cells; if the pool is still below 5, pool the next-smallest cell in too, and so on.
        while small < len(expected) and expected[:small].sum() < 5:
            small += 1
        counts = torch.cat([counts[:small].sum().reshape(1), counts[small:]])
        expected = torch.cat([expected[:small].sum().reshape(1), expected[small:]])
    df = len(expected) - 1
    assert df >= 1, "too few cells left for a chi-square test"
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_chi_square_p_value_is_calibrated():
    # The helper itself: a known case (df = 1, stat = 3.841459 -> p = 0.05) and pooling of sparse cells.
    counts = torch.tensor([50.0 + math.sqrt(3.841459 * 25), 50.0 - math.sqrt(3.841459 * 25)])
    assert chi_square_p_value(counts, torch.tensor([0.5, 0.5])) == pytest.approx(0.05, rel=1e-4)
    # Expected [600, 396, 2, 2]: the two cells of 2 pool with the 396 one to reach 5, so the 4-vs-0 split between
    # them does not count (unpooled it would give stat 4 on df 3); pooled, the counts match exactly: p = 1.
    probs = torch.tensor([0.6, 0.396, 0.002, 0.002], dtype=torch.float64)
    assert chi_square_p_value(torch.tensor([600.0, 396.0, 4.0, 0.0]), probs) == pytest.approx(1.0, abs=1e-6)


def test_sampled_frequencies_match_transformers_distribution_at_low_temperature():
    temperature, top_k, n = 0.5, 8, 20_000
    logits = torch.randn(12, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature=temperature, top_k=top_k)
    generator = torch.Generator().manual_seed(1234)
    draws = torch.tensor([sample(logits, params, generator) for _ in range(n)])
    counts = torch.bincount(draws, minlength=logits.shape[-1])

    oracle = oracle_probabilities(logits, temperature, top_k, 1.0)
    assert int((oracle > 0).sum()) == top_k
    p_value = chi_square_p_value(counts, oracle)
    assert p_value > 1e-3, f"draws do not follow transformers' distribution (chi-square p = {p_value:.3g})"

    # Power: the same draws must clearly reject the distribution of the temperature applied the wrong way round
    # (logits * T, i.e. temperature 1 / T), so a passing test above is evidence, not a test too weak to fail.
    wrong_way = oracle_probabilities(logits, 1 / temperature, top_k, 1.0)
    wrong_p_value = chi_square_p_value(counts, wrong_way)
    assert wrong_p_value < 1e-6, f"the test cannot tell T from 1/T (chi-square p = {wrong_p_value:.3g})"


def test_greedy_tokens_is_argmax_with_the_first_maximum_on_ties():
    from nanomm.sampling import greedy_tokens
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 151_936, generator=g)
    logits[1, 1000] = logits[1, 90_000] = 50.0  # a tie across blocks: the first one wins
    logits[2, 130] = logits[2, 131] = 50.0  # a tie inside a block
    logits[3] = 0.0  # all equal: index 0
    assert greedy_tokens(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(logits)[1:4].tolist() == [1000, 130, 0]
    odd = torch.randn(3, 1001, generator=g)  # a vocabulary that is not a whole number of blocks
    assert greedy_tokens(odd).tolist() == odd.argmax(dim=-1).tolist()

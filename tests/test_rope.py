"""M-RoPE position ids against transformers' get_rope_index, and the rotary helpers' basic contracts."""

import random

import pytest
import torch

from nanomm.model.rope import inverse_frequencies, mrope_cos_sin, mrope_positions

import transformers  # the oracle (dev extra); a missing oracle must fail, not skip
IMAGE, START, END = 955, 952, 953


@pytest.fixture(scope="module")
def hf_model():
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=1000, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]}),
        vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=32),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    return transformers.Qwen2VLModel(cfg).eval()


def random_prompt(rng: random.Random, num_images: int):
    ids, grids = [], []
    for _ in range(num_images):
        ids += [rng.randrange(900) for _ in range(rng.randrange(0, 6))]
        grid = (1, 2 * rng.randrange(1, 6), 2 * rng.randrange(1, 6))
        ids += [START] + [IMAGE] * (grid[1] * grid[2] // 4) + [END]
        grids.append(grid)
    ids += [rng.randrange(900) for _ in range(rng.randrange(1, 6))]
    return ids, grids


@pytest.mark.parametrize("seed", range(12))
def test_positions_and_delta_match_transformers(hf_model, seed):
    rng = random.Random(seed)
    ids, grids = random_prompt(rng, num_images=seed % 4)
    positions, delta = mrope_positions(ids, grids, IMAGE, spatial_merge_size=2)
    input_ids = torch.tensor([ids])
    expected, expected_delta = hf_model.get_rope_index(
        input_ids, (input_ids == IMAGE).int(), torch.tensor(grids) if grids else None)
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(expected_delta)


def test_worked_example_from_the_reference_notes():
    # ids [a, b, VS, I x6, VE, c], image grid [1, 4, 6] -> merged 1 x 2 x 3
    ids = [1, 2, START] + [IMAGE] * 6 + [END, 3]
    positions, delta = mrope_positions(ids, [(1, 4, 6)], IMAGE, 2)
    assert positions.tolist() == [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
                                  [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
                                  [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]]
    assert delta == 8 - 11


def test_text_only_is_plain_rope():
    positions, delta = mrope_positions(list(range(10)), [], IMAGE, 2)
    assert delta == 0 and torch.equal(positions, torch.arange(10).expand(3, -1))
    cos, sin = mrope_cos_sin(positions, head_dim=16, theta=1e6, mrope_section=(4, 2, 2), dtype=torch.float32)
    angles = torch.arange(10)[:, None].float() * inverse_frequencies(16, 1e6)
    torch.testing.assert_close(cos, torch.cat([angles, angles], -1).cos(), rtol=0, atol=0)
    torch.testing.assert_close(sin, torch.cat([angles, angles], -1).sin(), rtol=0, atol=0)


def test_image_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="image spans"):
        mrope_positions([1, START, IMAGE, END], [(1, 2, 2), (1, 2, 2)], IMAGE, 2)


def test_more_image_spans_than_grids_is_a_clear_error():
    with pytest.raises(ValueError, match="image spans"):
        mrope_positions([1, 5, 5, 2], [], image_token_id=5, spatial_merge_size=2)

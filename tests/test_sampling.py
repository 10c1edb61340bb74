"""`inference_core.sampling` on crafted logits: greedy is an argmax, top-k and top-p mask exactly the expected tokens
(in vocabulary order, not sorted order), sampled frequencies follow softmax(logits / temperature), a seed makes draws
reproducible, and `SamplingParams` normalizes its stop strings. Every draw uses a seeded generator, so the counts
below are the same on every run."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from inference_core.sampling import SamplingParams, make_generator, sample

CPU = torch.device("cpu")


def draw_counts(logits: torch.Tensor, params: SamplingParams, draws: int) -> Counter:
    generator = make_generator(params, CPU)
    return Counter(sample(logits, params, generator) for _ in range(draws))


def test_greedy_picks_the_argmax():
    params = SamplingParams()
    assert params.greedy and make_generator(params, CPU) is None
    assert sample(torch.tensor([0.1, 3.0, -1.0, 2.9]), params, None) == 1
    assert sample(torch.tensor([-5.0, -4.0, -3.5, -9.0]), params, None) == 2


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = torch.tensor([0.2, 0.1, 0.4, 0.3, 0.0])  # nearly flat: at temperature 5 every token is ~equally likely
    counts = draw_counts(logits, SamplingParams(temperature=5.0, top_k=1, seed=0), 500)
    assert counts == Counter({2: 500})


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([1.0, 3.0, 0.5, 2.0, 2.5, -1.0])
    counts = draw_counts(logits, SamplingParams(temperature=3.0, top_k=3, seed=1), 3000)
    assert set(counts) == {1, 3, 4}


@pytest.mark.parametrize("top_p", [0.75, 0.8])
def test_top_p_masks_the_tail(top_p):
    # probs 0.5, 0.3, 0.15, 0.05: tokens ranked above index 2 already reach 0.8, so only indices 0 and 1 stay.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = draw_counts(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=0), 2000)
    assert set(counts) == {0, 1}
    # Renormalized over the kept pair: 0.5 / 0.8 = 0.625 and 0.375.
    assert counts[0] / 2000 == pytest.approx(0.625, abs=0.04)


def test_top_p_masks_in_vocabulary_order():
    # The same distribution shuffled: the kept tokens are the two most likely, wherever they sit.
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    counts = draw_counts(logits, SamplingParams(temperature=1.0, top_p=0.8, seed=3), 2000)
    assert set(counts) == {1, 3}


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([0.05, 0.9, 0.05]).log()
    counts = draw_counts(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=0), 300)
    assert counts == Counter({1: 300})


def test_top_k_and_top_p_combine():
    # top_k=3 keeps indices 0, 1, 2 (probs renormalize to 0.5/0.95, 0.3/0.95, 0.15/0.95); top_p=0.8 then drops
    # index 2, because the two ranked above it hold 0.84 of the renormalized mass.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = draw_counts(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8, seed=5), 2000)
    assert set(counts) == {0, 1}


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_sampled_frequencies_follow_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    draws = 20000
    counts = draw_counts(logits, SamplingParams(temperature=temperature, seed=11), draws)
    expected = (logits / temperature).softmax(-1)
    observed = torch.tensor([counts[i] / draws for i in range(len(logits))])
    # One standard deviation of a frequency is at most sqrt(0.25 / 20000) = 0.0035; allow about four.
    torch.testing.assert_close(observed, expected, atol=0.015, rtol=0)


def test_same_seed_same_draws_different_seed_different_draws():
    logits = torch.zeros(1000)  # uniform over 1000 tokens
    params = SamplingParams(temperature=1.0, seed=42)

    def sequence(seed: int) -> list[int]:
        generator = make_generator(SamplingParams(temperature=1.0, seed=seed), CPU)
        return [sample(logits, params, generator) for _ in range(20)]

    assert sequence(42) == sequence(42)
    assert sequence(42) != sequence(43)  # equal by chance with probability 1e-60


def test_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=("a", "bc")).stop == ("a", "bc")
    assert SamplingParams().stop == ()

"""The on-device sampler (logits on an accelerator) draws the model's distribution, seeded per request, in one host
sync a step; it runs on CPU tensors too, which is how these tests reach it without a GPU."""

from __future__ import annotations

import torch

from compress.engine import SamplingParams
from compress.engine.sampler import sample_on_device

PROBABILITIES = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])


def _seeded(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def test_it_draws_the_distribution_it_is_given():
    rows = 4000
    logits = PROBABILITIES.log().expand(rows, -1).clone()  # the last token has probability 0: -inf
    params = [SamplingParams(temperature=1.0)] * rows
    tokens = torch.tensor(sample_on_device(logits, params, _seeded(range(rows))))
    frequencies = torch.bincount(tokens, minlength=5).double() / rows
    assert frequencies[4] == 0  # never a token of probability 0
    # binomial standard error <= sqrt(0.25 / 4000) = 0.0079: a bound of 0.035 is over four of them
    assert torch.allclose(frequencies, PROBABILITIES.double(), atol=0.035), frequencies


def test_a_seeded_row_does_not_depend_on_its_batch_mates_and_greedy_rows_take_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    greedy, top1 = SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=1)
    alone = [sample_on_device(logits[1:2], [seeded], _seeded([5]))[0]]
    generators = [None, torch.Generator().manual_seed(5), None]
    together = sample_on_device(logits, [greedy, seeded, top1], generators)
    assert together[1] == alone[0]
    assert together[0] == int(logits[0].argmax()) and together[2] == int(logits[2].argmax())


def test_a_seed_gives_the_same_tokens_again_and_another_seed_others():
    torch.manual_seed(1)
    logits = torch.randn(1, 1000)  # flat enough that 20 draws of two seeds coincide with negligible probability
    params = [SamplingParams(temperature=1.0)]

    def draws(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample_on_device(logits, params, [generator])[0] for _ in range(20)]

    assert draws(3) == draws(3) and draws(3) != draws(4)

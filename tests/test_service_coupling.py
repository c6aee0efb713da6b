"""The coupling math (docs/statistics.md §1, §2) on synthetic distributions: exact statistics."""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
from scipy import stats

from gen_service.coupling import Sampling, absorb_eos, maximal_coupling, probs, tv


def _pair(v: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp, lq = torch.randn(1, v, generator=g) * 1.5, torch.randn(1, v, generator=g) * 1.5
    return probs(lp, Sampling()), probs(lq, Sampling())


def test_tv_is_exactly_zero_for_equal_distributions() -> None:
    p, _ = _pair()
    assert tv(p, p.clone()).item() == 0.0


def test_tv_matches_one_minus_overlap() -> None:
    p, q = _pair()
    assert tv(p, q).item() == pytest.approx(1 - torch.minimum(p, q).sum().item(), abs=1e-6)


def test_mismatch_frequency_equals_tv_binomial() -> None:
    p, q = _pair(seed=1)
    n = 20_000
    d = maximal_coupling(p.expand(n, -1), q.expand(n, -1), torch.Generator().manual_seed(7))
    delta = tv(p, q).item()
    mismatches = int((d.x != d.y).sum())
    assert 0.05 < delta < 0.95
    assert stats.binomtest(mismatches, n, delta).pvalue > 1e-3


def test_marginals_are_exact_chi_square() -> None:
    p, q = _pair(seed=2)
    n = 20_000
    d = maximal_coupling(p.expand(n, -1), q.expand(n, -1), torch.Generator().manual_seed(8))
    for tokens, law in ((d.x, p[0]), (d.y, q[0])):
        counts = np.bincount(tokens.numpy(), minlength=law.numel())
        expected = law.double().numpy() * n
        assert stats.chisquare(counts, expected / expected.sum() * counts.sum()).pvalue > 1e-3


def test_mismatched_tokens_come_from_disjoint_residuals() -> None:
    p, q = _pair(seed=3)
    n = 5_000
    d = maximal_coupling(p.expand(n, -1), q.expand(n, -1), torch.Generator().manual_seed(9))
    split = d.x != d.y
    assert bool((p[0, d.x[split]] > q[0, d.x[split]]).all())
    assert bool((q[0, d.y[split]] > p[0, d.y[split]]).all())


def test_disjoint_supports_stop_and_always_differ() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 0.3, 0.7]])
    d = maximal_coupling(p.expand(100, -1), q.expand(100, -1), torch.Generator().manual_seed(0))
    assert bool(d.stop.all()) and bool((d.x != d.y).all()) and float(d.tv[0]) == 1.0


def test_sampling_transforms() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    greedy = probs(logits, Sampling(do_sample=False))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    assert torch.equal(probs(logits, Sampling(temperature=0.0)), greedy)
    top2 = probs(logits, Sampling(top_k=2))
    assert (top2[0, 2:] == 0).all() and top2[0, :2].sum().item() == pytest.approx(1.0)
    hot = probs(logits, Sampling(temperature=2.0))
    assert hot[0, 0] < probs(logits, Sampling())[0, 0]
    nucleus = probs(logits, Sampling(top_p=0.7))
    assert (nucleus[0, 2:] == 0).all() and nucleus[0, 1] > 0  # 0.665 < 0.7: the second token is needed


def test_eos_is_absorbing() -> None:
    p, _ = _pair()
    done = torch.tensor([True])
    out = absorb_eos(p, done, eos=3)
    assert out[0, 3] == 1.0 and out.sum() == 1.0
    assert torch.equal(absorb_eos(p, torch.tensor([False]), eos=3), p)


def test_generator_makes_draws_reproducible() -> None:
    p, q = _pair(seed=4)
    a = maximal_coupling(p.expand(50, -1), q.expand(50, -1), torch.Generator().manual_seed(3))
    b = maximal_coupling(p.expand(50, -1), q.expand(50, -1), torch.Generator().manual_seed(3))
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)

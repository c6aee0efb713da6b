"""The coupling math (docs/statistics.md §1, §2) on synthetic distributions: exact statistics."""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
from scipy import stats

from gen_service.engine import coupling
from gen_service.engine.coupling import History, absorb_eos, categorical, maximal_coupling, probs, tv
from gen_service.engine.jobs import Sampling


def _pair(v: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp, lq = torch.randn(1, v, generator=g) * 1.5, torch.randn(1, v, generator=g) * 1.5
    return probs(lp, Sampling()), probs(lq, Sampling())


def test_categorical_draws_the_weights_law_chi_square() -> None:
    """Unnormalised weights with zeros, a 1e-7 entry and a heavy one: the draws' counts fit
    the law (chi-square), zeros are never drawn."""
    w = torch.tensor([0.0, 3.0, 1e-7, 0.0, 1.0, 0.5, 2.5, 0.0, 1.0])
    n = 40_000
    x = categorical(w.expand(n, -1), torch.Generator().manual_seed(4))
    counts = np.bincount(x.numpy(), minlength=w.numel())
    assert counts[[0, 3, 7]].sum() == 0
    law = (w / w.sum()).double().numpy()
    keep = law > 1e-3
    assert stats.chisquare(counts[keep], law[keep] * n / law[keep].sum() * counts[keep].sum() / n).pvalue > 1e-3


def test_categorical_rows_are_independent_of_blocks_and_neighbours(monkeypatch) -> None:
    """Each row reads its own weights and its own uniform: drawing in blocks of rows (the
    memory cap) or beside other rows gives the same tokens; a row's last positive
    weight is drawn when u is the largest float64 below 1 (no index past the end)."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(7, 50, generator=g) * (torch.rand(7, 50, generator=g) > 0.5)
    whole = categorical(w, torch.Generator().manual_seed(1))
    monkeypatch.setattr(coupling, "CPU_CDF_BYTES", 8 * 50 * 2)      # two rows per block (the CPU budget)
    assert torch.equal(categorical(w, torch.Generator().manual_seed(1)), whole)
    assert torch.equal(w.gather(1, whole[:, None]) > 0, torch.ones(7, 1, dtype=torch.bool))
    last = torch.tensor([[0.0, 1.0, 2.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((1, 1), 1 - 2.0**-53, dtype=torch.float64))
    assert categorical(last, torch.Generator()).tolist() == [2]


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


def test_penalised_laws_first_step_mismatch_rate_is_their_tv() -> None:
    """Each side's law is the post-transform one, from its own history: the coupled
    first step splits with probability TV of the *transformed* laws (binomial), and X
    and Y follow them exactly (χ²), not the raw softmax."""
    g = torch.Generator().manual_seed(11)
    v = 8
    lp, lq = torch.randn(1, v, generator=g) * 1.5, torch.randn(1, v, generator=g) * 1.5
    s = Sampling(temperature=0.8, repetition_penalty=1.8, frequency_penalty=0.4, presence_penalty=0.3,
                 typical_p=0.95)
    hp, hq = History.start([0, 1, 1, 2], 1, v), History.start([3, 4, 4, 4], 1, v)
    p, q = probs(lp, s, hp), probs(lq, s, hq)
    delta, raw = tv(p, q).item(), tv(probs(lp, Sampling()), probs(lq, Sampling())).item()
    assert 0.05 < delta < 0.95 and abs(delta - raw) > 0.05  # the transforms matter here
    n = 20_000
    d = maximal_coupling(p.expand(n, -1), q.expand(n, -1), torch.Generator().manual_seed(12))
    assert stats.binomtest(int((d.x != d.y).sum()), n, delta).pvalue > 1e-3
    for tokens, law in ((d.x, p[0]), (d.y, q[0])):
        counts = np.bincount(tokens.numpy(), minlength=v)
        expected = law.double().numpy() * n
        keep = expected > 0
        assert counts[~keep].sum() == 0
        assert stats.chisquare(counts[keep], expected[keep] / expected[keep].sum() * n).pvalue > 1e-3


def test_transforms_match_transformers_processors() -> None:
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TypicalLogitsWarper,
    )

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 16, generator=g) * 2
    ids = torch.tensor([[1, 2, 2, 7]] * 3)
    history = History.start([1, 2], 3, 16).add(torch.tensor([2, 2, 2])).add(torch.tensor([7, 7, 7]))
    s = Sampling(temperature=0.7, top_k=9, repetition_penalty=1.3, typical_p=0.8)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(9), TypicalLogitsWarper(0.8)):
        ref = warper(ids, ref)
    assert torch.allclose(probs(logits, s, history), torch.softmax(ref, -1), atol=1e-6)
    counts = history.counts[0]
    assert counts[1] == 1 and counts[2] == 2 and counts[7] == 1 and counts.sum() == 4


def test_extreme_parameters_give_proper_laws() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, -1.0]])
    history = History.start([0, 1], 1, 4)
    for s in (Sampling(temperature=1e-300), Sampling(temperature=1e-45), Sampling(repetition_penalty=1e-30),
              Sampling(temperature=1e-300, repetition_penalty=1e-30, frequency_penalty=2.0)):
        p = probs(logits, s, history)
        assert torch.isfinite(p).all() and p.sum().item() == pytest.approx(1.0)
    # T -> 0 is the uniform law on the largest logits
    assert probs(torch.tensor([[1.0, 1.0, 0.5]]), Sampling(temperature=1e-300)).tolist() == [[0.5, 0.5, 0.0]]

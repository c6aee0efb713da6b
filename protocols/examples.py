"""Valid example traces, simulated from random tabular kernels.

:func:`example_dataset` runs the stepwise maximal coupling (docs/statistics.md §2) or the
residual-branch scheme (§5) on random next-token laws, vectorised over
(doc, policy, replicate), so tests, benchmarks and docs get traces that obey
every rule of the contract. The kernels depend only on the step and on whether a
side has emitted EOS; that is enough for the contract, not meant as a
language model (divstats' ``simulate`` is the estimator-grade simulator).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from protocols.kinds import Kind
from protocols.logit_fields import LOGIT_FIELDS, LOGIT_TOKENS, LOGIT_TOP, law_summaries, with_logits
from protocols.schema import coupled_dataset, reference_dataset, residual_dataset

__all__ = ["DEFAULT_POLICIES", "example_dataset"]

DEFAULT_POLICIES = ("snapkv@0.5", "snapkv#512", "recent@0.5", "snapkv@0.9")


def _kernels(rng: np.random.Generator, D: int, P: int, T: int, V: int,
             disjoint: float) -> tuple[np.ndarray, np.ndarray]:
    """p, q laws shaped (doc, policy, step, vocab); some steps get disjoint point masses (TV 1)."""
    p = rng.dirichlet(np.full(V, 0.7), size=(D, P, T))
    lam = rng.uniform(0.05, 0.6, size=(1, P, 1, 1))   # how far each policy drifts
    q = (1 - lam) * p + lam * rng.dirichlet(np.full(V, 0.7), size=(D, P, T))
    q[:, :, 0] = p[:, :, 0]                            # step 1: eviction cannot act yet (TV 0)
    hit = rng.random((D, P, T)) < disjoint
    hit[:, :, 0] = False
    a = rng.integers(0, V, size=(D, P, T))
    b = (a + 1 + rng.integers(0, V - 1, size=(D, P, T))) % V
    eye = np.eye(V)
    p = np.where(hit[..., None], eye[a], p)
    q = np.where(hit[..., None], eye[b], q)
    return p, q


def _absorb(law: np.ndarray, done: np.ndarray, eos: int) -> np.ndarray:
    """After EOS a side's law is the point mass on EOS."""
    if eos < 0:
        return law
    point = np.zeros(law.shape[-1])
    point[eos] = 1.0
    return np.where(done[..., None], point, law)


def _draw(rng: np.random.Generator, w: np.ndarray) -> np.ndarray:
    """One categorical draw per row of unnormalised weights (rows of zeros give 0)."""
    c = np.cumsum(w, axis=-1)
    u = rng.random(w.shape[:-1] + (1,)) * c[..., -1:]
    return np.minimum((c <= u).sum(-1), w.shape[-1] - 1)


def _couple(rng: np.random.Generator, p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One step of the stepwise maximal coupling: (tv, x, y)."""
    m = np.minimum(p, q)
    rp, rq = np.clip(p - q, 0, None), np.clip(q - p, 0, None)
    tv = np.clip(0.5 * np.abs(p - q).sum(-1), 0.0, 1.0)
    split = (rng.random(tv.shape) < tv) & (rp.sum(-1) > 0) & (rq.sum(-1) > 0)
    z = _draw(rng, m)
    x = np.where(split, _draw(rng, rp), z)
    y = np.where(split, _draw(rng, rq), z)
    return tv, x, y


def _coupled(rng: np.random.Generator, p: np.ndarray, q: np.ndarray, R: int, eos: int,
             laws: list | None = None) -> tuple[np.ndarray, ...]:
    D, P, T, V = p.shape
    tv = np.zeros((D, P, R, T))
    x = np.zeros((D, P, R, T), dtype=np.int64)
    y = np.zeros_like(x)
    xd = np.zeros((D, P, R), dtype=bool)
    yd = np.zeros_like(xd)
    for t in range(T):   # steps are sequential by nature; everything else is vectorised
        pt = _absorb(np.broadcast_to(p[:, :, None, t], (D, P, R, V)), xd, eos)
        qt = _absorb(np.broadcast_to(q[:, :, None, t], (D, P, R, V)), yd, eos)
        if laws is not None:
            laws.append((pt, qt, np.ones((D, P, R), dtype=bool)))
        tv[..., t], x[..., t], y[..., t] = _couple(rng, pt, qt)
        if eos >= 0:
            xd |= x[..., t] == eos
            yd |= y[..., t] == eos
    return tv, x, y


def _residual(rng: np.random.Generator, p: np.ndarray, q: np.ndarray, R: int, W: int, eos: int,
              laws: tuple[list, list] | None = None) -> tuple:
    D, P, T, V = p.shape
    shape = (D, P, R)
    stv = np.full(shape + (T,), np.nan)
    stok = np.full(shape + (T,), -1, dtype=np.int64)
    alive = np.ones(shape, dtype=bool)
    zd = np.zeros(shape, dtype=bool)
    for t in range(T):
        pt = _absorb(np.broadcast_to(p[:, :, None, t], shape + (V,)), zd, eos)
        qt = _absorb(np.broadcast_to(q[:, :, None, t], shape + (V,)), zd, eos)
        m = np.minimum(pt, qt)
        tv = np.clip(0.5 * np.abs(pt - qt).sum(-1), 0.0, 1.0)
        z = _draw(rng, m)
        stv[..., t] = np.where(alive, tv, np.nan)
        if laws is not None:
            laws[0].append((pt, qt, alive.copy()))
        running = alive & (tv < 1)
        stok[..., t] = np.where(running, z, -1)
        alive = running
        if eos >= 0:
            zd |= running & (z == eos)
    # Law of tau given Z: pi_t = S_{t-1} delta_t; t* ~ pi / (1 - S_T).
    d = np.nan_to_num(stv)
    S = np.cumprod(1 - d, axis=-1)
    pi = np.concatenate([np.ones(shape + (1,)), S[..., :-1]], axis=-1) * d
    has = pi.sum(-1) > 0
    t_star = np.where(has, _draw(rng, pi) + 1, 0)
    return stv, stok, t_star, _branches(rng, p, q, t_star, W, eos, None if laws is None else laws[1])


def _branches(rng: np.random.Generator, p: np.ndarray, q: np.ndarray, t_star: np.ndarray, W: int,
              eos: int, laws: list | None = None) -> tuple[np.ndarray, ...]:
    D, P, R = t_star.shape
    T = p.shape[2]
    btv = np.full((D, P, R, T), np.nan)
    bx = np.full((D, P, R, T), -1, dtype=np.int64)
    by = np.full_like(bx, -1)
    K = np.where(t_star > 0, np.minimum(W, T - t_star), -1)
    xd = np.zeros((D, P, R), dtype=bool)   # the shared prefix before t* holds no EOS (TV there > 0)
    yd = np.zeros_like(xd)
    pe, qe = p[:, :, None], q[:, :, None]
    for k in range(T):
        on = k <= K
        if not on.any():
            break
        idx = np.clip(t_star - 1 + k, 0, T - 1)[..., None, None]
        pt = np.take_along_axis(pe, idx, axis=3)[..., 0, :]
        qt = np.take_along_axis(qe, idx, axis=3)[..., 0, :]
        pt, qt = _absorb(pt, xd, eos), _absorb(qt, yd, eos)
        if laws is not None:
            laws.append((pt, qt, on))
        if k == 0:   # the divergence step itself: X ~ (p-q)+, Y ~ (q-p)+
            tv = np.clip(0.5 * np.abs(pt - qt).sum(-1), 0.0, 1.0)
            x, y = _draw(rng, np.clip(pt - qt, 0, None)), _draw(rng, np.clip(qt - pt, 0, None))
        else:
            tv, x, y = _couple(rng, pt, qt)
        btv[..., k] = np.where(on, tv, np.nan)
        bx[..., k] = np.where(on, x, -1)
        by[..., k] = np.where(on, y, -1)
        if eos >= 0:
            xd |= on & (x == eos)
            yd |= on & (y == eos)
    return btv, bx, by


def _reference(rng: np.random.Generator, p: np.ndarray, q: np.ndarray, R: int, eos: int) -> tuple[np.ndarray, ...]:
    D, P, T, V = p.shape
    x = np.zeros((D, P, R, T), dtype=np.int64)
    lp = np.zeros((D, P, R, T))
    lq = np.zeros((D, P, R, T))
    done = np.zeros((D, P, R), dtype=bool)
    with np.errstate(divide="ignore"):
        for t in range(T):
            pt = _absorb(np.broadcast_to(p[:, :, None, t], (D, P, R, V)), done, eos)
            qt = _absorb(np.broadcast_to(q[:, :, None, t], (D, P, R, V)), done, eos)
            xt = _draw(rng, pt)
            x[..., t] = xt
            lp[..., t] = np.log(np.take_along_axis(pt, xt[..., None], -1)[..., 0])
            lq[..., t] = np.log(np.take_along_axis(qt, xt[..., None], -1)[..., 0])
            if eos >= 0:
                done |= xt == eos
    return x, lp, lq


def _path_logits(laws: list, k: int, length: int | None = None) -> dict[str, np.ndarray]:
    """The logit fields of one path's (p, q, observed) per time index, stacked on its last axis
    (padded to ``length`` ages, unobserved: NaN / -1)."""
    n = len(laws) if length is None else length
    out = {}
    for name in LOGIT_FIELDS:
        per = []
        for t in range(n):
            if t < len(laws):
                pt, qt, seen = laws[t]
                a = law_summaries(pt, qt, k)[name].astype(np.float64)
                mask = seen[..., None] if name in LOGIT_TOP else seen
                a = np.where(mask, a, -1 if name in LOGIT_TOKENS else np.nan)
            else:
                shape = laws[0][2].shape + ((k,) if name in LOGIT_TOP else ())
                a = np.full(shape, -1.0 if name in LOGIT_TOKENS else np.nan)
            per.append(a)
        out[name] = np.stack(per, axis=3)
    return out


def example_dataset(
    kind: str = "coupled",
    *,
    docs: int | Sequence[str] = 2,
    policies: int | Sequence[str] = 2,
    replicates: int = 4,
    horizon: int = 8,
    vocab_size: int = 6,
    window: int | None = None,
    eos_token_id: int | None = 0,
    disjoint: float = 0.02,
    seed: int = 0,
    model: str = "example-kernels",
    top_logprobs: int = 0,
) -> xr.Dataset:
    """A valid ``kind`` dataset simulated from random kernels (reproducible from ``seed``).

    ``docs`` / ``policies`` are counts or id lists; ``disjoint`` is the chance that a
    step's two laws are disjoint point masses (TV 1, which stops a survival path).

    Parameters
    ----------
    kind : {"coupled", "residual", "reference"}
        The trace kind to simulate.
    docs, policies : int or sequence of str
        Counts (ids ``doc000``..., ``DEFAULT_POLICIES``) or the ids themselves.
    replicates, horizon, vocab_size : int
        R, T and V.
    window : int, optional
        W for residual traces (default T).
    eos_token_id : int or None, default 0
        The absorbing EOS token; None for no EOS.
    disjoint : float, default 0.02
        Chance of a TV-1 step.
    seed : int, default 0
        Seed of the random generator.
    model : str
        The ``model`` attr.
    top_logprobs : int, default 0
        k > 0 adds the logit traces (:mod:`protocols.logit_fields`) of coupled and residual
        traces, computed from the kernels' laws.

    Returns
    -------
    xarray.Dataset
        A dataset that passes :func:`protocols.validate.validate`.

    Raises
    ------
    ValueError
        An unknown ``kind``.

    Examples
    --------
    >>> ds = example_dataset("residual", docs=3, replicates=2, horizon=5, window=2)
    >>> dict(ds.sizes)
    {'doc': 3, 'policy': 2, 'replicate': 2, 'step': 5, 'age': 5}
    """
    rng = np.random.default_rng(seed)
    doc_ids = [f"doc{i:03d}" for i in range(docs)] if isinstance(docs, int) else list(docs)
    pol_ids = list(DEFAULT_POLICIES[:policies]) if isinstance(policies, int) else list(policies)
    if isinstance(policies, int) and policies > len(DEFAULT_POLICIES):
        pol_ids = [f"snapkv@{(i + 1) / (policies + 1):.3f}" for i in range(policies)]
    eos = -1 if eos_token_id is None else int(eos_token_id)
    p, q = _kernels(rng, len(doc_ids), len(pol_ids), horizon, vocab_size, disjoint)
    common = dict(vocab_size=vocab_size, docs=doc_ids, policies=pol_ids, eos_token_id=eos_token_id,
                  model=model, producer="protocols.examples", prompt_tokens=[100 + 7 * i for i in range(len(doc_ids))])
    k = int(top_logprobs)
    if k and kind not in (Kind.COUPLED, Kind.RESIDUAL):
        raise ValueError(f"top_logprobs: example {kind} traces have no logit traces (coupled or residual)")
    if kind == Kind.COUPLED:
        laws: list = []
        ds = coupled_dataset(*_coupled(rng, p, q, replicates, eos, laws if k else None), **common)
        return with_logits(ds, _path_logits(laws, k)) if k else ds
    if kind == Kind.RESIDUAL:
        W = horizon if window is None else int(window)
        paths: tuple[list, list] = ([], [])
        stv, stok, t_star, (btv, bx, by) = _residual(rng, p, q, replicates, W, eos, paths if k else None)
        ds = residual_dataset(stv, stok, t_star, btv, bx, by, window=W, **common)
        if k:
            ds = with_logits(ds, _path_logits(paths[0], k), "shared_")
            ds = with_logits(ds, _path_logits(paths[1], k, horizon), "branch_")
        return ds
    if kind == Kind.REFERENCE:
        return reference_dataset(*_reference(rng, p, q, replicates, eos), **common)
    raise ValueError(f"kind {kind!r} is not one of coupled, residual, reference")

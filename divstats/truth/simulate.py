"""Simulate trace datasets from tabular kernels (docs/statistics.md §2, §5, §7, §9).

``simulate`` draws replicates exactly as a producer must: the stepwise maximal
coupling for ``coupled`` traces, the survival path plus one residual branch for
``residual`` traces, and P-samples with log p and log q for ``reference`` traces.
It is a test instrument for small kernels (one Python step per token); the
estimators never depend on it, and it depends on none of them: the survival
terms S_t and pi_t of the branch point are computed here (:func:`_survival_terms`,
the formula of ``divstats.traces.replicates.survival_terms``) rather than imported,
so the truth the estimators are checked against shares no code with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from divstats.truth.kernels import CoupledKernels, Kernel, StepLaw, inverse_cdf_draw
from protocols import TRACE_KINDS, Kind, coupled_dataset, reference_dataset, residual_dataset, validate

__all__ = ["simulate", "simulate_grid"]



def _coupled_step(law: StepLaw, u: np.ndarray) -> tuple[int, int]:
    """One draw of (X_t, Y_t) from the maximal coupling, using three uniforms."""
    if u[0] < law.tv:
        return inverse_cdf_draw(law.x_res, u[1]), inverse_cdf_draw(law.y_res, u[2])
    z = inverse_cdf_draw(law.shared, u[1])
    return z, z


def _simulate_coupled(kern: CoupledKernels, T: int, n: int, rng: np.random.Generator):
    tv = np.zeros((n, T))
    xt = np.zeros((n, T), dtype=np.int32)
    yt = np.zeros((n, T), dtype=np.int32)
    u = rng.random((n, T, 3))
    for r in range(n):
        xh: tuple[int, ...] = ()
        yh: tuple[int, ...] = ()
        for s in range(T):
            law = kern.law(xh, yh)
            x, y = _coupled_step(law, u[r, s])
            tv[r, s], xt[r, s], yt[r, s] = law.tv, x, y
            xh, yh = xh + (x,), yh + (y,)
    return tv, xt, yt


def _survival_path(kern: CoupledKernels, T: int, u: np.ndarray):
    """Shared path: record tv, draw Z from min(p, q)/(1 - tv); stop at tv = 1."""
    tvs = np.full(T, np.nan)
    toks = np.full(T, -1, dtype=np.int32)
    z: tuple[int, ...] = ()
    for s in range(T):
        law = kern.law(z, z)
        tvs[s] = law.tv
        if law.shared is None:  # tv = 1: nothing survives past this step
            break
        toks[s] = inverse_cdf_draw(law.shared, u[s])
        z = z + (int(toks[s]),)
    return tvs, toks


def _survival_terms(tvs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S_t, pi_t = S_{t-1} tv_t) along one survival path, NaN TVs after it stops read as 0."""
    d = np.fmax(tvs.astype(np.float64), 0.0)
    s = np.cumprod(1.0 - d, axis=-1)
    s_prev = np.concatenate([np.ones(s.shape[:-1] + (1,)), s[..., :-1]], axis=-1)
    return s, s_prev * d


def _branch_point(tvs: np.ndarray, u: float) -> int:
    """t* ~ pi_t / (1 - S_T) with pi_t = S_{t-1} tv_t; 0 when 1 - S_T = 0."""
    _, pi = _survival_terms(tvs)
    if pi.sum() <= 0.0:
        return 0
    return inverse_cdf_draw(pi, u) + 1


def _simulate_residual(kern: CoupledKernels, T: int, W: int, n: int, rng: np.random.Generator):
    stv = np.full((n, T), np.nan)
    stok = np.full((n, T), -1, dtype=np.int32)
    bstep = np.zeros(n, dtype=np.int32)
    btv = np.full((n, T), np.nan)
    bx = np.full((n, T), -1, dtype=np.int32)
    by = np.full((n, T), -1, dtype=np.int32)
    u_path = rng.random((n, T))
    u_point = rng.random(n)
    u_branch = rng.random((n, T, 3))
    for r in range(n):
        stv[r], stok[r] = _survival_path(kern, T, u_path[r])
        t_star = _branch_point(stv[r], u_point[r])
        bstep[r] = t_star
        if t_star == 0:
            continue
        z = tuple(int(v) for v in stok[r, : t_star - 1])
        law = kern.law(z, z)
        # age 0: the two residual draws (the branches differ by construction)
        x = inverse_cdf_draw(law.x_res, u_branch[r, 0, 1])
        y = inverse_cdf_draw(law.y_res, u_branch[r, 0, 2])
        btv[r, 0], bx[r, 0], by[r, 0] = law.tv, x, y
        xh, yh = z + (x,), z + (y,)
        for k in range(1, min(W, T - t_star) + 1):
            law = kern.law(xh, yh)
            x, y = _coupled_step(law, u_branch[r, k])
            btv[r, k], bx[r, k], by[r, k] = law.tv, x, y
            xh, yh = xh + (x,), yh + (y,)
    return stv, stok, bstep, btv, bx, by


def _simulate_reference(kern: CoupledKernels, T: int, n: int, rng: np.random.Generator):
    xt = np.zeros((n, T), dtype=np.int32)
    lp = np.zeros((n, T))
    lq = np.zeros((n, T))
    u = rng.random((n, T))
    with np.errstate(divide="ignore"):
        for r in range(n):
            xh: tuple[int, ...] = ()
            for s in range(T):
                p, q = kern.p(xh), kern.q(xh)  # Q evaluated on P's own sample
                x = inverse_cdf_draw(p, u[r, s])
                xt[r, s], lp[r, s], lq[r, s] = x, np.log(p[x]), np.log(q[x])
                xh = xh + (x,)
    return xt, lp, lq


def simulate(
    p: Kernel,
    q: Kernel,
    vocab_size: int,
    horizon: int,
    replicates: int,
    kind: str = "coupled",
    window: int | None = None,
    seed: int = 0,
    eos: int | None = None,
    doc: str = "doc0",
    policy: str = "candidate",
) -> xr.Dataset:
    """Simulate a validated trace dataset (one doc, one policy) from tabular kernels.

    ``kind="coupled"``: complete trajectories of the stepwise maximal coupling
    (docs/statistics.md §2).  ``kind="residual"``: a survival path, a branch point
    t* ~ pi / (1 - S_T) and the two branches for K = min(W, T - t*) steps (§5).
    ``kind="reference"``: samples from P with log p and log q of each token (§7).
    ``window`` (residual only) is W; None means the branches run to the horizon.
    Randomness comes from ``np.random.default_rng(seed)``.

    Parameters
    ----------
    p, q : callable
        Kernels: a history (tuple of the branch's own tokens) → probabilities over
        ``vocab_size`` tokens; P is evaluated on X's history, Q on Y's.
    vocab_size : int
        V.
    horizon : int
        T.
    replicates : int
        Replicates per dataset.
    kind : {"coupled", "residual", "reference"}
        The trace kind (docs/contract.md).
    window : int, optional
        W for residual traces.
    seed : int
        Seed of the generator.
    eos : int, optional
        Absorbing end-of-sequence token.
    doc, policy : str
        Coordinates of the single document and policy.

    Returns
    -------
    xarray.Dataset
        A validated ``kvdiv.trace/1`` dataset over (doc, policy, replicate, step).

    Raises
    ------
    ValueError
        For an unknown kind, sizes below 1, or a window on non-residual traces.

    Examples
    --------
    >>> import numpy as np
    >>> p = lambda h: np.array([0.6, 0.4])
    >>> q = lambda h: np.array([0.5, 0.5])
    >>> ds = simulate(p, q, 2, horizon=4, replicates=3, seed=1)
    >>> dict(ds.sizes)["replicate"], ds.attrs["kind"]
    (3, 'coupled')
    """
    return simulate_grid([[(p, q)]], [[seed]], vocab_size, horizon, replicates, kind=kind, window=window, eos=eos,
                         docs=[doc], policies=[policy])


def simulate_grid(kernels: Sequence[Sequence[tuple[Kernel, Kernel]]], seeds: Sequence[Sequence[int]],
                  vocab_size: int, horizon: int, replicates: int, *, kind: str = "coupled",
                  window: int | None = None, eos: int | None = None, docs: Sequence[str],
                  policies: Sequence[str]) -> xr.Dataset:
    """Simulate every (doc, policy) of a grid of kernel pairs into one validated dataset.

    Each pair is drawn as :func:`simulate` draws it with its own seed; the arrays are
    stacked over (doc, policy) and the dataset is built and validated once (a study of
    many pairs built no dataset per pair to concatenate).

    Parameters
    ----------
    kernels : sequence of sequences of (callable, callable)
        ``kernels[d][j]`` is document d's (P, Q) under policy j.
    seeds : sequence of sequences of int
        ``seeds[d][j]``: the seed of that pair's draws.
    vocab_size, horizon, replicates : int
        V, T and replicates per pair.
    kind : {"coupled", "residual", "reference"}
        The trace kind.
    window : int, optional
        W for residual traces.
    eos : int, optional
        Absorbing end-of-sequence token.
    docs, policies : sequence of str
        The ids along each axis of the grid.

    Returns
    -------
    xarray.Dataset
        What :func:`simulate` returns, over every document and policy of the grid.

    Raises
    ------
    ValueError
        For an unknown kind, sizes below 1, an empty grid, ids that do not match it, or a
        window on non-residual traces.

    Examples
    --------
    >>> import numpy as np
    >>> p = lambda h: np.array([0.6, 0.4])
    >>> q = lambda h: np.array([0.5, 0.5])
    >>> ds = simulate_grid([[(p, q), (p, p)]], [[1, 2]], 2, 4, 3, docs=["d"], policies=["a", "b"])
    >>> dict(ds.sizes)
    {'doc': 1, 'policy': 2, 'replicate': 3, 'step': 4}
    """
    T, n, W = _sizes(kind, horizon, replicates, window)
    shape = (len(docs), len(policies))
    if not all(shape) or len(kernels) != shape[0] or len(seeds) != shape[0] or \
            any(len(row) != shape[1] for row in [*kernels, *seeds]):
        raise ValueError(f"a grid of {shape[0]} docs x {shape[1]} policies needs kernels and seeds of that shape")
    pairs = [[CoupledKernels(p, q, vocab_size, eos) for p, q in row] for row in kernels]
    grid = [[_draw(kern, kind, T, W, n, int(seed)) for kern, seed in zip(row, row_seeds, strict=True)]
            for row, row_seeds in zip(pairs, seeds, strict=True)]
    arrays = tuple(np.stack([np.stack([pair[k] for pair in row]) for row in grid]) for k in range(len(grid[0][0])))
    return _dataset(kind, arrays, vocab_size=vocab_size, window=min(W, T), eos=pairs[0][0].eos, docs=list(docs),
                    policies=list(policies))


def _sizes(kind: str, horizon: int, replicates: int, window: int | None) -> tuple[int, int, int]:
    """(T, n, W) checked: W is T when no window is given."""
    if kind not in TRACE_KINDS:
        raise ValueError(f"kind must be one of {TRACE_KINDS}, got {kind!r}")
    if horizon < 1 or replicates < 1:
        raise ValueError("horizon and replicates must be >= 1")
    if window is not None and kind != Kind.RESIDUAL:
        raise ValueError(f"window applies to residual traces only (truncate {kind} traces in estimate)")
    W = int(horizon) if window is None else int(window)
    if W < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    return int(horizon), int(replicates), W


def _draw(kern: CoupledKernels, kind: str, T: int, W: int, n: int, seed: int) -> tuple[np.ndarray, ...]:
    """The arrays of one (doc, policy)'s traces, in the dataset builder's argument order."""
    rng = np.random.default_rng(seed)
    if kind == Kind.COUPLED:
        return _simulate_coupled(kern, T, n, rng)
    if kind == Kind.RESIDUAL:
        return _simulate_residual(kern, T, W, n, rng)
    return _simulate_reference(kern, T, n, rng)


def _dataset(kind: str, arrays: tuple[np.ndarray, ...], *, vocab_size: int, window: int, eos: int | None,
             docs: list[str], policies: list[str]) -> xr.Dataset:
    """The validated dataset of ``_draw``'s arrays stacked over (doc, policy)."""
    common = dict(vocab_size=vocab_size, docs=docs, policies=policies, eos_token_id=eos,
                  producer="divstats.simulate")
    if kind == Kind.COUPLED:
        ds = coupled_dataset(*arrays, **common)
    elif kind == Kind.RESIDUAL:
        ds = residual_dataset(*arrays, window=window, **common)
    else:
        ds = reference_dataset(*arrays, **common)
    validate(ds)  # the simulator is a producer: it must honour the contract it tests against
    return ds

"""Kernel pairs shared by the divstats tests: small tabular P, Q with known features.

Each case is (name, p, q, vocab_size, horizon, eos).  Together they cover no EOS
and absorbing EOS, near point-mass kernels, steps with TV = 1, a pair that never
diverges, and history dependence (so the branches' laws differ after divergence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xarray as xr


@dataclass(frozen=True)
class Case:
    name: str
    p: Callable
    q: Callable
    vocab_size: int
    horizon: int
    eos: int | None = None


def _markov(table: dict[int | None, list[float]]):
    """Kernel depending on the last token only (None: empty history)."""
    arrs = {k: np.asarray(v, dtype=float) for k, v in table.items()}
    return lambda h: arrs.get(h[-1] if h else None, arrs[None])


def _hashed(seed: int, V: int, conc: float):
    """A kernel with full history dependence: Dirichlet law keyed by the whole history."""
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def k(h):
        if h not in cache:
            rng = np.random.default_rng([seed, len(h), *h])
            cache[h] = rng.dirichlet(np.full(V, conc))
        return cache[h]
    return k


MARKOV_P = _markov({None: [0.5, 0.3, 0.2], 1: [0.2, 0.2, 0.6]})
MARKOV_Q = _markov({None: [0.4, 0.4, 0.2], 2: [0.1, 0.6, 0.3]})

CASES = [
    Case("markov3", MARKOV_P, MARKOV_Q, 3, 4),
    Case("markov3_eos", MARKOV_P, MARKOV_Q, 3, 4, eos=2),
    Case("near_point_mass",
         _markov({None: [0.995, 0.004, 0.001], 1: [0.002, 0.997, 0.001]}),
         _markov({None: [0.985, 0.005, 0.010], 2: [0.001, 0.001, 0.998]}), 3, 5),
    # After token 0, P and Q have disjoint supports: TV = 1 on the survival path.
    Case("tv_one",
         _markov({None: [0.6, 0.4, 0.0], 0: [0.7, 0.3, 0.0]}),
         _markov({None: [0.5, 0.5, 0.0], 0: [0.0, 0.0, 1.0]}), 3, 4),
    Case("never_diverge", _hashed(7, 3, 1.0), _hashed(7, 3, 1.0), 3, 4),
    Case("hashed4_eos", _hashed(1, 4, 0.7), _hashed(2, 4, 0.7), 4, 5, eos=3),
    # Q ends early and often: one branch ended, the other still emitting.
    Case("early_eos",
         _markov({None: [0.6, 0.3, 0.1], 0: [0.3, 0.5, 0.2]}),
         _markov({None: [0.3, 0.2, 0.5], 1: [0.2, 0.2, 0.6]}), 3, 4, eos=2),
]

CASE_IDS = [c.name for c in CASES]


def split_replicates(ds: xr.Dataset, groups: int) -> xr.Dataset:
    """Turn one (1 doc, n replicates) dataset into `groups` docs of n/groups replicates.

    Each new document is an independent repetition of the same experiment, so one
    vectorised ``estimate`` gives the sampling distribution of the estimator.
    """
    n = ds.sizes["replicate"] // groups
    ds = ds.isel(doc=0, replicate=slice(0, n * groups), drop=True)
    doc = np.repeat(np.arange(groups), n)
    rep = np.tile(np.arange(n), groups)
    ds = ds.assign_coords(doc=("replicate", [f"g{i}" for i in doc]), rep=("replicate", rep))
    ds = ds.set_index(replicate=["doc", "rep"]).unstack("replicate").rename(rep="replicate")
    return ds.transpose("doc", "policy", "replicate", ...)

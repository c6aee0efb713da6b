"""The adaptive collection's estimates against exact values, on simulated documents.

``kvdiv collect --target-se/--budget`` collects a pilot, then rounds of further
replicates that :func:`divstats.design.rounds.plan_round` allocates from the data so
far, and the estimate leaves the pilot out (docs/design.md, "Spending further replicates
where they pay"). :func:`simulate_adaptive` runs that procedure many times on documents
whose every estimand ``divstats.exact`` enumerates, laying the rounds out as ``kvdiv
pack`` does (round blocks along ``replicate``, absent slots, the ``round`` coordinate),
and :func:`bias_table` measures the bias of the reported estimate and of the estimate
that pools the pilot in. Used by tests/test_adaptive.py and ``benchmarks/bench_adaptive.py``;
like every module of this room, no production room imports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import xarray as xr

import protocols
from divstats.design.rounds import counted_replicates, plan_round
from divstats.estimation.estimators import estimate
from divstats.truth.exact import exact
from divstats.truth.simulate import simulate
from divstats.truth.studies import PolicyEffect, markov_kernels

__all__ = ["bias_table", "simulate_adaptive"]


class _Pool:
    """Replicates drawn ahead for every simulated (doc, policy), handed out in order: each is used once."""

    def __init__(self, draw: Callable[[int], xr.Dataset], size: int) -> None:
        self.draw, self.size = draw, size
        self.data = draw(size)
        self.cursor = np.zeros((self.data.sizes["doc"], self.data.sizes["policy"]), dtype=int)

    def take(self, counts: np.ndarray, width: int) -> np.ndarray:
        """Indices (doc, policy, width) of ``counts`` fresh replicates per pair, -1 in the slots left absent."""
        if int((self.cursor + counts).max()) > self.data.sizes["replicate"]:
            more = self.draw(max(self.size, int(counts.max())))
            self.data = xr.concat([self.data, more], dim="replicate", data_vars="minimal", coords="minimal",
                                   compat="override", join="override")
        slot = np.arange(width)
        index = np.where(slot < counts[..., None], self.cursor[..., None] + slot, -1)
        self.cursor += counts
        return index

    def dataset(self, index: np.ndarray, widths: Sequence[int]) -> xr.Dataset:
        """The traces ``kvdiv pack`` would write: these replicates in round blocks of ``widths`` slots
        (round 0's R, then each later round's largest allocation), absent slots as the contract's."""
        n = index.shape[-1]
        out = self.data.isel(replicate=slice(0, n)).assign_coords(replicate=np.arange(n, dtype=np.int32))
        safe = np.maximum(index, 0)
        taken_vars = {}
        for name, var in self.data.data_vars.items():
            if "replicate" not in var.dims:
                continue
            rest = [d for d in var.dims if d not in ("doc", "policy", "replicate")]
            values = var.transpose("doc", "policy", "replicate", *rest).values
            idx = np.broadcast_to(safe.reshape(safe.shape + (1,) * len(rest)), safe.shape + values.shape[3:])
            taken = np.take_along_axis(values, idx, axis=2)
            taken[index < 0] = protocols.absent_value(str(name), values.dtype)
            taken_vars[name] = (("doc", "policy", "replicate", *rest), taken)
        out = out.assign(taken_vars)   # one merge, not one per variable: this runs a few times per repetition
        if len(widths) > 1:   # an adaptive collection: the round of each slot, as collector.rounds lays it out
            out = out.assign_coords(round=("replicate", np.repeat(np.arange(len(widths), dtype=np.int32), widths)))
        return out


def simulate_adaptive(metrics: Sequence[str], *, target_se: Mapping[str, float] | None = None,
                      budget: float | None = None, budget_unit: str = "replicates", by: str = "cell",
                      max_rounds: int = 1, min_replicates: int = 2, docs: int = 6,
                      effects: Sequence[float] = (0.06, 0.15), horizon: int = 5, window: int | None = None,
                      vocab_size: int = 4, pilot_replicates: int = 3, repetitions: int = 100, doc_sd: float = 0.3,
                      seed: int = 0) -> xr.Dataset:
    """Run the adaptive procedure on simulated documents and compare its estimates with the exact values.

    Each (document, policy) is a small Markov pair of kernels
    (``divstats.markov_kernels``) whose estimands ``divstats.exact``
    enumerates. A repetition simulates the pilot (residual traces), then, round by
    round, asks :func:`~divstats.design.rounds.plan_round` (what ``kvdiv collect`` asks,
    with the same settings) for the next allocation and gives each pair that many fresh
    replicates, laid out in round blocks with absent slots as ``kvdiv pack`` lays them out
    (``collector.rounds.RoundLayout``), and finally estimates with
    ``divstats.estimate`` (which leaves out round 0). Replicates are drawn ahead in
    one batch per pair (``divstats.simulate``) and each is used once, which is the
    same as drawing them round by round.

    Parameters
    ----------
    metrics : sequence of str
        The metrics the allocation targets (and whose estimates are compared).
    target_se, budget, budget_unit, by, max_rounds, min_replicates
        The allocation's settings, as :func:`~divstats.design.rounds.plan_round` takes them
        (``kvdiv.adaptive.AdaptiveSpec.round_settings`` gives a command's).
    docs : int
        Documents; each has its own kernels and a strength multiplier exp(N(0, doc_sd)).
    effects : sequence of float
        One simulated policy per strength (``PolicyEffect``).
    horizon, window, vocab_size : int
        T, W (None: T) and V.
    pilot_replicates : int
        R of round 0.
    repetitions : int
        Independent runs of the whole procedure.
    doc_sd : float
        SD of the documents' log strength multiplier.
    seed : int
        Seed of the documents and of every draw.

    Returns
    -------
    xarray.Dataset
        Over (repetition, doc, policy): for each metric m, ``m`` (the estimate
        ``kvdiv analyze`` reports: rounds >= 1), ``m_pooled`` (round 0 pooled in) and,
        over (doc, policy), ``m_exact``; ``counted`` (replicates of rounds >= 1) and,
        per repetition, ``rounds`` (rounds after the pilot).

    Examples
    --------
    >>> sim = simulate_adaptive(("occurrence",), budget=30, docs=2, repetitions=2)
    >>> sorted(sim.data_vars)
    ['counted', 'occurrence', 'occurrence_exact', 'occurrence_pooled', 'rounds']
    """
    settings = dict(target_se=target_se, budget=budget, budget_unit=budget_unit, by=by, max_rounds=max_rounds,
                    min_replicates=min_replicates)
    rng = np.random.default_rng(seed)
    policies = [f"p{j}" for j in range(len(effects))]
    kernels, exact_values = {}, {}
    for d in range(docs):
        scale = float(np.exp(rng.normal(0.0, doc_sd)))
        for j, effect in enumerate(effects):
            p, q = markov_kernels(seed * 100_003 + d, j, PolicyEffect(effect), vocab_size, scale)
            kernels[(f"doc{d}", policies[j])] = (p, q)
            exact_values[(f"doc{d}", policies[j])] = exact(p, q, vocab_size, horizon, window)

    def draw(n: int) -> xr.Dataset:
        per_doc = [protocols.combine([simulate(*kernels[(f"doc{d}", pol)], vocab_size, horizon, n,
                                               kind="residual", window=window,
                                               seed=int(rng.integers(2 ** 31)), doc=f"doc{d}", policy=pol)
                                      for pol in policies], dim="policy", validate=False) for d in range(docs)]
        return protocols.combine(per_doc, dim="doc", validate=False)

    pool = _Pool(draw, repetitions * (pilot_replicates + 16))
    rows = []
    for _ in range(repetitions):
        widths = [pilot_replicates]   # slots of each round: R, then each later round's largest allocation
        blocks = [pool.take(np.full(pool.cursor.shape, pilot_replicates), pilot_replicates)]
        k = 1
        while (plan := plan_round(pool.dataset(np.concatenate(blocks, -1), widths), metrics, k,
                                  **settings)).replicates:
            counts = plan.further.transpose("doc", "policy").values
            widths.append(int(counts.max()))
            blocks.append(pool.take(counts, widths[-1]))
            k += 1
        data = pool.dataset(np.concatenate(blocks, -1), widths)
        est, pooled = estimate(data), estimate(data.drop_vars("round", errors="ignore"))
        rows.append(xr.Dataset({**{m: est[m] for m in metrics},
                                **{f"{m}_pooled": pooled[m] for m in metrics},
                                "counted": counted_replicates(data), "rounds": k - 1}))
    out = xr.concat(rows, dim="repetition", coords="minimal", compat="override")
    out = out.drop_vars([c for c in out.coords if c not in ("doc", "policy")])
    for m in metrics:
        values = [[exact_values[(str(d), str(p))][m] for p in out["policy"].values] for d in out["doc"].values]
        out[f"{m}_exact"] = (("doc", "policy"), np.array(values, dtype=float))
    return out.assign_attrs(metrics=list(metrics), allocation=json.dumps(settings),
                            pilot_replicates=pilot_replicates, horizon=horizon)


def bias_table(sim: xr.Dataset, metrics: Sequence[str]) -> list[dict[str, float | str]]:
    """Bias of the adaptive and the pooled estimates in a :func:`simulate_adaptive` result.

    Parameters
    ----------
    sim : xarray.Dataset
        :func:`simulate_adaptive`'s output.
    metrics : sequence of str
        Metrics to report.

    Returns
    -------
    list of dict
        Per metric and estimate (``rounds >= 1`` or ``pooled``): the mean over cells
        of the bias relative to the exact value, its SE over repetitions, the largest
        |z| of a cell's bias, and the mean bias in the metric's units.

    Examples
    --------
    >>> sim = simulate_adaptive(("occurrence",), budget=30, docs=2, repetitions=3)
    >>> [(r["metric"], r["estimate"]) for r in bias_table(sim, ["occurrence"])]
    [('occurrence', 'rounds >= 1'), ('occurrence', 'pooled with the pilot')]
    """
    rows = []
    for m in metrics:
        truth = sim[f"{m}_exact"]
        for name, var in (("rounds >= 1", m), ("pooled with the pilot", f"{m}_pooled")):
            err = sim[var] - truth
            n = sim.sizes["repetition"]
            z = err.mean("repetition") / (err.std("repetition", ddof=1) / np.sqrt(n))
            rel = (err / truth).mean(["doc", "policy"])   # one number per repetition: its SE is honest
            rows.append({"metric": m, "estimate": name, "relative_bias": float(rel.mean()),
                         "se": float(rel.std(ddof=1) / np.sqrt(n)), "max_abs_z": float(np.abs(z).max()),
                         "bias": float(err.mean())})
    return rows

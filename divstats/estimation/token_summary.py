"""The per-token numbers people already read, from logit traces: KL, top-1 agreement, greedy flips (§12).

llama.cpp's ``--kl-divergence`` summarises a quantised model against the full one by the
per-token KL(P‖Q) (mean and upper quantiles) and how often the two models' most likely
tokens agree.  :func:`token_summary` gives the same numbers per policy, with intervals over
documents (the document is the unit; each document's tokens summarised first):

* ``token_kl_mean``, ``token_kl_q90``, ``token_kl_q99``: per document, the mean, 90th and
  99th percentile of KL(P‖Q) over its observed tokens (every replicate's steps pooled);
  then the mean over documents of each, with its interval.  (So ``q90`` is the average
  document's 90th percentile, not the 90th percentile of the pooled tokens.)  A document
  with an infinite KL (P puts mass where Q has none) makes the mean infinite and its
  interval is not given.
* ``token_top1_agreement``: the fraction of observed steps where P's and Q's most likely
  tokens agree (``p_top_token[0] == q_top_token[0]``), per document, then over documents.
  On coupled traces the steps are the coupled paths' (after the first mismatch each model
  conditions on its own history); on reference traces P's sampled history.
* ``token_flip_rate``: the teacher-forced greedy flip rate, the fraction of steps where a
  greedy Q would emit another token than a greedy P *on the same history*: on reference
  traces every step (Q is run on P's tokens); on coupled traces the steps up to and
  including the first mismatch τ (until then the two share the history).

Intervals: :func:`divstats.estimation.resample.document_interval` (t over documents, clipped
to [0, 1] for the fractions), refused below ``MIN_DOCS_AGGREGATE`` documents.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from divstats.estimation.resample import MIN_DOCS_AGGREGATE, document_interval
from protocols import Kind

__all__ = ["TOKEN_SUMMARIES", "token_summary"]

#: The summaries, and what each is (results.nc descriptions).
TOKEN_SUMMARIES: dict[str, str] = {
    "token_kl_mean": "mean over documents of each document's mean per-token KL(P||Q) in nats",
    "token_kl_q90": "mean over documents of each document's 90th percentile of per-token KL(P||Q)",
    "token_kl_q99": "mean over documents of each document's 99th percentile of per-token KL(P||Q)",
    "token_top1_agreement": "fraction of steps where P's and Q's most likely tokens agree (per document, then mean)",
    "token_flip_rate": ("teacher-forced greedy flip rate: fraction of steps on a shared history (reference traces: "
                        "P's; coupled: up to the first mismatch) where P's and Q's most likely tokens differ"),
}
_UNIT = ("token_top1_agreement", "token_flip_rate")


def _per_doc(v: np.ndarray, q: float | None) -> np.ndarray:
    """(docs, tokens) with NaN = unobserved -> per-document mean (q None) or quantile q."""
    out = np.full(v.shape[0], math.nan)
    for i, row in enumerate(v):
        row = row[~np.isnan(row)]
        if row.size:
            # an infinite KL has no interpolation partner: take the order statistic there
            out[i] = row.mean() if q is None else np.quantile(row, q, method="linear" if np.isfinite(row).all()
                                                              else "higher")
    return out


def token_summary(ds: xr.Dataset, level: float = 0.95) -> xr.Dataset:
    """Per policy: KL(P‖Q) per token (mean, q90, q99), top-1 agreement and the greedy flip rate.

    Parameters
    ----------
    ds : xarray.Dataset
        Coupled or reference traces with logit traces (``kl_pq``, ``p_top_token``,
        ``q_top_token``; ``top_logprobs`` >= 1 at collection).
    level : float
        Confidence level of the intervals over documents.

    Returns
    -------
    xarray.Dataset
        Over ``policy`` (and ``model``): each name of :data:`TOKEN_SUMMARIES` with ``_low``
        and ``_high``, and ``token_n_docs``, ``token_n_tokens``; empty without logit traces.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> ts = token_summary(example_dataset("coupled", top_logprobs=2, horizon=5))
    >>> 0 <= float(ts["token_top1_agreement"].max()) <= 1
    True
    """
    if not all(v in ds.data_vars for v in ("kl_pq", "p_top_token", "q_top_token")):
        return xr.Dataset()
    kind = ds.attrs.get("kind")
    if kind not in (Kind.COUPLED, Kind.REFERENCE):
        return xr.Dataset()
    extra = [d for d in ds["kl_pq"].dims if d not in ("doc", "replicate", "step")]
    order = (*extra, "doc", "replicate", "step")
    kl = ds["kl_pq"].transpose(*order).values.astype(np.float64)
    p1 = ds["p_top_token"].isel(top=0).transpose(*order).values
    q1 = ds["q_top_token"].isel(top=0).transpose(*order).values
    seen = (p1 >= 0) & (q1 >= 0)
    agree = np.where(seen, (p1 == q1).astype(float), np.nan)
    if kind == Kind.COUPLED:
        x, y = (ds[n].transpose(*order).values for n in ("x_token", "y_token"))
        steps = np.arange(1, x.shape[-1] + 1)
        differ = (x != y) & (x >= 0) & (y >= 0)
        tau = np.where(differ.any(-1), differ.argmax(-1) + 1, x.shape[-1] + 1)
        shared = steps <= tau[..., None]
        flip = np.where(seen & shared, 1.0 - agree, np.nan)
    else:
        flip = 1.0 - agree
    shape = tuple(ds.sizes[d] for d in extra)
    n_docs = ds.sizes["doc"]
    names = list(TOKEN_SUMMARIES)
    out = {k: np.full(shape, math.nan) for n in names for k in (n, n + "_low", n + "_high")}
    out["token_n_docs"], out["token_n_tokens"] = np.zeros(shape), np.zeros(shape)
    for idx in np.ndindex(*shape):
        flat = {a: b[idx].reshape(n_docs, -1) for a, b in (("kl", kl), ("agree", agree), ("flip", flip))}
        per_doc = {"token_kl_mean": _per_doc(flat["kl"], None), "token_kl_q90": _per_doc(flat["kl"], 0.9),
                   "token_kl_q99": _per_doc(flat["kl"], 0.99), "token_top1_agreement": _per_doc(flat["agree"], None),
                   "token_flip_rate": _per_doc(flat["flip"], None)}
        for name, v in per_doc.items():
            v = v[~np.isnan(v)]
            if not v.size:
                continue
            out[name][idx] = v.mean()
            if np.isinf(v).any():
                continue
            ci = document_interval((v,), lambda a: a.mean(-1)[None], level=level, method="jackknife-t",
                                   min_docs=MIN_DOCS_AGGREGATE)
            lo, hi = float(ci.low[0]), float(ci.high[0])
            if name in _UNIT and np.isfinite(lo):
                lo, hi = max(lo, 0.0), min(hi, 1.0)
            elif np.isfinite(lo):
                lo = max(lo, 0.0)
            out[name + "_low"][idx], out[name + "_high"][idx] = lo, hi
        out["token_n_docs"][idx] = int(np.sum(~np.isnan(per_doc["token_kl_mean"])))
        out["token_n_tokens"][idx] = int(np.sum(~np.isnan(flat["kl"])))
    coords = {d: ds[d].values for d in extra if d in ds.coords}
    desc = {**TOKEN_SUMMARIES, "token_n_docs": "documents with an observed token",
            "token_n_tokens": "observed tokens (steps x replicates x documents)"}
    data = {}
    for k, v in out.items():
        base = k.removesuffix("_low").removesuffix("_high")
        what = desc[base] if k == base else f"{'lower' if k.endswith('_low') else 'upper'} end of the {level:g} " \
                                            f"interval over documents of {base}"
        data[k] = (extra, v, {"description": what})
    return xr.Dataset(data, coords=coords, attrs={"level": level, "kind": str(kind)})

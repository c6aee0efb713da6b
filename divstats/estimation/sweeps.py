"""Policy families (sweeps) in a dataset: the KV each policy keeps, a family's members in order.

A *family* is one method at several amounts (``snapkv@0.9``, ``snapkv@0.7``, ...;
``protocols.policies``, "Families").  Here a dataset's policies are grouped into
families and each family is ordered from the most to the least KV kept, the order the
certification (``divstats.inference.certify``) tests them in and the x-axis of the
fidelity-against-budget curves (``divstats.estimation.budget_curves``).

**KV kept.** The fraction of the prompt cache a policy keeps (:func:`kv_kept`): the
*achieved* retention where the traces record it (a press that decides its own amount,
e.g. a threshold), else the nominal one: the ``retention`` coordinate, or for a
budget in tokens ``min(1, budget / prompt_tokens)`` averaged over documents.  The
achieved retention is read from a variable or coordinate named
:data:`ACHIEVED_RETENTION` over ``policy`` (and optionally ``doc``/``model``), the name
the trace header's "achieved retention" is to be stored under; until servers write it,
the nominal retention is used (the hook is this one name).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import xarray as xr

from divstats.errors import DivstatsError
from protocols.policies import PolicyIdError, expand_policy_family, family_key, policy_coords, policy_families

__all__ = ["ACHIEVED_RETENTION", "family_values", "kv_kept", "resolve_family", "sweep_families"]

#: Where a dataset records the retention a press achieved (per policy, or per doc and policy).
ACHIEVED_RETENTION = "achieved_retention"


def kv_kept(ds: xr.Dataset) -> xr.DataArray:
    """The fraction of the prompt's KV cache each policy keeps, over ``policy``.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset or ``divstats.estimate``'s output (the ``policy`` coordinates
        ``retention``, ``budget`` and, for budgets, ``prompt_tokens`` over ``doc``).

    Returns
    -------
    xarray.DataArray
        Over ``policy``: the achieved retention where recorded (:data:`ACHIEVED_RETENTION`,
        averaged over every other dim), else the nominal retention, or for a budget
        ``min(1, budget / prompt_tokens)`` averaged over the documents with a known prompt
        length; 1 for ``full``; NaN where nothing says.  ``attrs["source"]`` says which.

    Examples
    --------
    >>> import xarray as xr
    >>> ds = xr.Dataset(coords={"policy": ["full", "a@0.5", "a#64"], "retention": ("policy", [1.0, 0.5, float("nan")]),
    ...                         "budget": ("policy", [-1, -1, 64]), "prompt_tokens": ("doc", [128, 256])})
    >>> kv_kept(ds).values.tolist()
    [1.0, 0.5, 0.375]
    """
    policies = [str(p) for p in ds["policy"].values]
    nominal = np.full(len(policies), math.nan)
    if "retention" in ds.coords or "retention" in ds:
        nominal = np.asarray(ds["retention"].values, dtype=float).copy()
    budget = np.asarray(ds["budget"].values, dtype=float) if ("budget" in ds.coords or "budget" in ds) else \
        np.full(len(policies), -1.0)
    # the id's own amount is the definition (and fixes the family's order before any data); the
    # coordinates only speak for ids outside the grammar
    for i, pid in enumerate(policies):
        _, r, b = policy_coords(pid)
        if b >= 1:
            nominal[i], budget[i] = math.nan, b
        elif not math.isnan(r):
            nominal[i], budget[i] = r, -1
    prompt = np.asarray(ds["prompt_tokens"].values, dtype=float) if "prompt_tokens" in ds.coords else np.array([])
    prompt = prompt[prompt > 0]
    for i, b in enumerate(budget):
        if b >= 1 and math.isnan(nominal[i]):
            nominal[i] = float(np.minimum(1.0, b / prompt).mean()) if prompt.size else math.nan
    nominal = np.where([p == "full" for p in policies], 1.0, nominal)
    source = "nominal"
    if ACHIEVED_RETENTION in ds.variables:
        achieved = ds[ACHIEVED_RETENTION]
        other = [d for d in achieved.dims if d != "policy"]
        values = np.asarray(achieved.mean(other, skipna=True).values, dtype=float) if other else \
            np.asarray(achieved.values, dtype=float)
        nominal = np.where(np.isfinite(values), values, nominal)
        source = "achieved where recorded, else nominal"
    return xr.DataArray(nominal, dims=("policy",), coords={"policy": ds["policy"].values}, name="kv_kept",
                        attrs={"description": "fraction of the prompt's KV cache the policy keeps", "source": source})


def sweep_families(ds: xr.Dataset, min_members: int = 2) -> dict[str, tuple[str, ...]]:
    """The dataset's policy families, each ordered from the most to the least KV kept (:func:`kv_kept`).

    Parameters
    ----------
    ds : xarray.Dataset
        Traces or estimates.
    min_members : int
        Leave out families with fewer members (2: a curve needs two points).

    Returns
    -------
    dict of str to tuple of str
        ``protocols.family_key`` (``snapkv@*``) -> member policy ids.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(8, {"snapkv@0.9": PolicyEffect(0.01), "snapkv@0.5": PolicyEffect(0.1),
    ...                         "snapkv@0.3": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> sweep_families(ds)
    {'snapkv@*': ('snapkv@0.9', 'snapkv@0.5', 'snapkv@0.3')}
    """
    kept = kv_kept(ds)
    return policy_families([str(p) for p in ds["policy"].values],
                           kept={str(p): float(v) for p, v in zip(kept["policy"].values, kept.values, strict=True)},
                           min_members=min_members)


def resolve_family(ds: xr.Dataset, family: str) -> tuple[str, tuple[str, ...]]:
    """A family named in a plan or a call -> (its key, its members in the dataset, most KV kept first).

    ``family`` may be a key (``snapkv@*``, ``snapkv#*``), a bare press name (``snapkv``:
    the retention family if the data have one, else the budget family), or a family
    written out (``snapkv@0.9,0.7,0.5``, ``snapkv@0.9..0.3/0.2``: exactly those members).

    Parameters
    ----------
    ds : xarray.Dataset
        Traces or estimates.
    family : str
        A family key, a bare press name or a written-out family.

    Returns
    -------
    key : str
        The family's key (``snapkv@*``).
    members : tuple of str
        Its members present in ``ds``, most KV kept first.

    Raises
    ------
    DivstatsError
        When nothing in the data matches, naming the families that are there.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(8, {"snapkv@0.9": PolicyEffect(0.01), "snapkv@0.5": PolicyEffect(0.1),
    ...                         "snapkv@0.3": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> resolve_family(ds, "snapkv")
    ('snapkv@*', ('snapkv@0.9', 'snapkv@0.5', 'snapkv@0.3'))
    >>> resolve_family(ds, "snapkv@0.3,0.9")
    ('snapkv@*', ('snapkv@0.9', 'snapkv@0.3'))
    """
    families = sweep_families(ds, min_members=1)
    available = [str(p) for p in ds["policy"].values]
    if family in families:
        return family, families[family]
    for key in (f"{family}@*", f"{family}#*"):
        if key in families:
            return key, families[key]
    try:
        members = expand_policy_family(family)
    except PolicyIdError:
        members = ()
    if len(members) >= 1 and family_key(members[0]):
        missing = [m for m in members if m not in available]
        if missing:
            raise DivstatsError(f"family {family!r}: policies {missing} are not in the data "
                                f"(available: {available})")
        key = family_key(members[0])
        order = families.get(key, members)
        return key, tuple(p for p in order if p in members)
    raise DivstatsError(f"family {family!r} is not in the data; its families are {sorted(families)} "
                        f"(a bare name such as 'snapkv' or a written-out family such as 'snapkv@0.9,0.5' also works)")


def family_values(estimates: xr.Dataset, family: str, metric: str, *, model: str | None = None,
                  docs: Sequence[str] | None = None) -> tuple[np.ndarray, tuple[str, ...], np.ndarray, list[str]]:
    """One estimand's per-document values over a family's members, most KV kept first.

    Parameters
    ----------
    estimates : xarray.Dataset
        ``divstats.estimate(ds)`` (per doc and policy[, model]).
    family : str
        As :func:`resolve_family` takes it.
    metric : str
        A variable of ``estimates``.
    model : str, optional
        Required when the data have a ``model`` dim.
    docs : sequence of str, optional
        Only these documents (e.g. a plan's confirmatory split).

    Returns
    -------
    values : numpy.ndarray
        (document x member).
    members : tuple of str
        The member policy ids, most KV kept first.
    kept : numpy.ndarray
        :func:`kv_kept` of each member.
    doc_ids : list of str
        The documents, in the rows' order.

    Raises
    ------
    DivstatsError
        When ``metric`` is not in ``estimates``, the data hold several models and
        ``model`` is not given, or the family is not in the data.

    Examples
    --------
    >>> import divstats
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(8, {"snapkv@0.9": PolicyEffect(0.01), "snapkv@0.5": PolicyEffect(0.1),
    ...                         "snapkv@0.3": PolicyEffect(0.2)}, horizon=6, replicates=4)
    >>> values, members, kept, doc_ids = family_values(divstats.estimate(ds), "snapkv", "occurrence")
    >>> values.shape, members, kept.tolist(), doc_ids[:2]
    ((8, 3), ('snapkv@0.9', 'snapkv@0.5', 'snapkv@0.3'), [0.9, 0.5, 0.3], ['doc0', 'doc1'])
    """
    if metric not in estimates:
        raise DivstatsError(f"metric {metric!r} is not a variable of the estimates")
    est = estimates
    if "model" in est.dims:
        if model is None:
            raise DivstatsError(f"the data hold models {[str(m) for m in est['model'].values]}: name one (model=...)")
        est = est.sel(model=model)
    _, members = resolve_family(est, family)
    if docs is not None:
        est = est.sel(doc=list(docs))
    values = np.asarray(est[metric].sel(policy=list(members)).transpose("doc", "policy").values, dtype=float)
    kept = kv_kept(est).sel(policy=list(members)).values
    return values, members, np.asarray(kept, dtype=float), [str(d) for d in est["doc"].values]

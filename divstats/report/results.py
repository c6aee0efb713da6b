"""``results.nc``: every number of an analysis as one xarray Dataset, and its file I/O.

Variable prefixes say which public function produced each number (the table is
in docs/report.md): no prefix: ``estimate`` (doc, policy); ``aggregate_``:
``aggregate``; ``aggregate_ci_``: ``aggregate_intervals``; ``survival``/
``survival_se`` (step 0..T); ``branch_tv*`` (age); ``interval_`` (window W);
``variance_`` (``variance_check``); ``decomposition_`` (comparison); ``plan_``
(hypothesis row; ``plan_split`` per doc; absent without a plan); ``logit_``
(``logit_curves``: KL and entropies by step and by age, only for traces with logit traces);
``answer_`` (``compare_answers_dataset`` per policy, the divergence split, the depth map and
accuracy against budget: only for traces with answer scores) and ``token_`` (``token_summary``:
KL per token, top-1 agreement, greedy flips; only with logit traces); ``accuracy`` and
``accuracy_change`` per (doc, policy) beside the estimates.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5netcdf
import numpy as np
import xarray as xr

from divstats.inference.decompose import DecompositionInterval, DecompositionResult
from divstats.report.answers import answers_results, keep_descriptions
from divstats.traces.arrays import without_attrs

if TYPE_CHECKING:
    from divstats.report.analysis import Analysis

__all__ = ["RESULTS_TITLE", "clean_attrs", "is_results", "load_results", "results_dataset", "save_results"]

#: The ``title`` attribute of every results.nc: how kvdiv recognises its own outputs.
RESULTS_TITLE = "kvdiv analysis results"
EXPLORATORY_STATUS = "exploratory (descriptive; not in the plan)"


def _prefixed(ds: xr.Dataset, prefix: str) -> xr.Dataset:
    return ds.rename({v: f"{prefix}{v}" for v in ds.data_vars})


def _decomposition_dataset(decs: list[tuple[DecompositionResult, DecompositionInterval]]) -> xr.Dataset:
    if not decs:
        return xr.Dataset()
    parts = [without_attrs(res.to_dataset().merge(ci.to_dataset())) for res, ci in decs]
    out = xr.concat(parts, dim="comparison")
    out = out.assign_coords(comparison=[f"{r.a} vs {r.b}" for r, _ in decs],
                            comparison_a=("comparison", [r.a for r, _ in decs]),
                            comparison_b=("comparison", [r.b for r, _ in decs]))
    return _prefixed(out, "decomposition_")


def clean_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """netCDF-safe attributes: str, int and float kept; bools as int; anything else as JSON.

    Parameters
    ----------
    attrs : mapping
        Attribute values of any type.

    Returns
    -------
    dict
        The same keys with values netCDF can store.

    Examples
    --------
    >>> clean_attrs({"a": True, "b": [1, 2], "c": "x"})
    {'a': 1, 'b': '[1, 2]', 'c': 'x'}
    """
    out = {}
    for k, v in attrs.items():
        if isinstance(v, (bool, np.bool_)):
            out[k] = int(v)
        elif isinstance(v, (int, float, str, np.integer, np.floating)):
            out[k] = v
        else:
            out[k] = json.dumps(v, default=str)
    return out


def _plan_parts(an: Analysis) -> list[xr.Dataset]:
    """The plan table over ``hypothesis`` and ``plan_split`` over ``doc`` (none without a plan)."""
    pr = an.plan_result
    if pr is None:
        return []
    split = pr.split.set_index("doc")
    docs = an.estimates["doc"].values
    labels = split.loc[[str(d) for d in docs], "split"].to_numpy(dtype=object)
    return [without_attrs(pr.to_dataset()), xr.Dataset({"plan_split": ("doc", labels)}, coords={"doc": docs})]


def _global_attrs(an: Analysis) -> dict[str, Any]:
    tr = an.traces.attrs
    plan, pr = an.plan, an.plan_result
    exploratory = ("every variable except plan_* is descriptive (exploratory); plan_confirmatory marks "
                   "the confirmatory plan rows") if plan is not None else (
                   "no plan: every variable is descriptive (exploratory)")
    return clean_attrs({
        "title": RESULTS_TITLE, "plan_name": plan.name if plan else "", "plan_sha256": plan.sha256 if plan else "",
        "plan_source": plan.source if plan else "", "deviations": json.dumps(pr.deviations if pr else []),
        "notes": json.dumps(an.notes), "exploratory": exploratory,
        "kind": tr.get("kind", ""), "horizon": int(tr.get("horizon", 0)), "trace_window": int(tr.get("window", 0)),
        "model": str(tr.get("model", "")), "sampling": str(tr.get("sampling", "")),
        "producer": str(tr.get("producer", "")), "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        **{f"option_{k}": v for k, v in an.options.items()},
    })


def results_dataset(an: Analysis) -> xr.Dataset:
    """One Dataset with every reported number; prefixes say where each comes from.

    Parameters
    ----------
    an : Analysis
        A computed analysis (``divstats.report.analysis.compute``).

    Returns
    -------
    xarray.Dataset
        Variables as listed in the module docstring and docs/report.md; each has a
        ``status`` attr (plan result or exploratory); global attrs name the plan,
        its SHA-256, deviations, notes, the trace attributes and the options.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=3)
    >>> res = results_dataset(compute(ds, n_resamples=99, progress=False))
    >>> res.attrs["title"], "aggregate_occurrence" in res
    ('kvdiv analysis results', True)
    """
    parts = [without_attrs(an.estimates),
             _prefixed(without_attrs(an.aggregate), "aggregate_"),
             _prefixed(without_attrs(an.aggregate_ci), "aggregate_ci_"),
             without_attrs(an.survival)]
    if an.branch_tv is not None:
        parts.append(without_attrs(an.branch_tv))
    if an.interval is not None:
        parts.append(_prefixed(without_attrs(an.interval), "interval_").rename(window="interval_window"))
    if an.variance is not None:
        parts.append(_prefixed(without_attrs(an.variance), "variance_"))
    if an.logit_curves is not None and an.logit_curves.data_vars:
        parts.append(without_attrs(an.logit_curves))
    parts.append(_decomposition_dataset(an.decompositions))
    parts += _plan_parts(an)
    if an.speculative is not None:
        parts.append(_prefixed(without_attrs(an.speculative), "speculative_"))
    if an.compression is not None:
        parts.append(_compression_dataset(an))
    answer_parts = answers_results(an.answers)
    parts += answer_parts
    floor = an.noise_floor
    if floor is not None and floor.data_vars:
        parts.append(_prefixed(without_attrs(floor), "noise_floor_"))
    out = xr.merge(parts, compat="override", join="outer", combine_attrs="drop")
    keep_descriptions(out, answer_parts)      # the answers' variables say what each is (docs/report.md)
    for name, var in out.data_vars.items():
        var.attrs["status"] = ("plan result: see plan_label for confirmatory/exploratory"
                               if name.startswith("plan_") else EXPLORATORY_STATUS)
    out.attrs = _global_attrs(an)
    if floor is not None:  # the control's policy id, or the sentence saying there was none
        out.attrs["noise_floor"] = str(floor.attrs.get("control") or floor.attrs.get("note", ""))
    return out


def _compression_dataset(an: Analysis) -> xr.Dataset:
    """"How much can I compress?": the curves over (compression_family, compression_budget[, model]) and
    one row per certification (and model) over ``certification``; every name prefixed, so nothing clashes
    with the estimates' ``policy``."""
    c = an.compression
    names = {n: f"compression_{n}" for n in [*c.data_vars, "family", "budget", "policy", "kept"]}
    out = without_attrs(c).rename(names)
    for v in out.data_vars:
        if out[v].dtype == object:
            out[v] = out[v].astype(str)
    out["compression_policy"] = out["compression_policy"].astype(str)
    pr = an.plan_result
    if pr is not None and len(pr.certify):
        t = pr.certify.reset_index(drop=True)
        out = out.assign({f"certify_{col}": ("certification", np.array(
            ["" if v is None else str(v) for v in t[col]], dtype=object) if t[col].dtype == object
            else t[col].to_numpy()) for col in t.columns})
    return out


def save_results(results: xr.Dataset, path: str | Path) -> Path:
    """Write results.nc with h5netcdf (strings as variable-length UTF-8).

    Parameters
    ----------
    results : xarray.Dataset
        :func:`results_dataset`'s output.
    path : str or pathlib.Path
        Target file (written as is; ``divstats.report.write`` handles safe replacement).

    Returns
    -------
    pathlib.Path
        ``path``.

    Examples
    --------
    >>> import tempfile, xarray as xr
    >>> p = save_results(xr.Dataset({"x": ("a", [1.0])}, attrs={"title": RESULTS_TITLE}),
    ...                  tempfile.mkdtemp() + "/results.nc")
    >>> is_results(p)
    True
    """
    path = Path(path)
    enc = {}
    for name, var in {**results.data_vars, **results.coords}.items():
        if var.dtype == object:
            enc[name] = {"dtype": str}
    results.to_netcdf(path, engine="h5netcdf", encoding=enc)
    return path


def load_results(path: str | Path) -> xr.Dataset:
    """Read results.nc back (strings decoded).

    Parameters
    ----------
    path : str or pathlib.Path
        A file :func:`save_results` wrote.

    Returns
    -------
    xarray.Dataset
        Loaded into memory (the file is closed).

    Examples
    --------
    >>> import tempfile, xarray as xr
    >>> p = save_results(xr.Dataset({"x": ("a", [1.0])}), tempfile.mkdtemp() + "/r.nc")
    >>> float(load_results(p)["x"][0])
    1.0
    """
    return xr.load_dataset(path, engine="h5netcdf")


def is_results(path: str | Path) -> bool:
    """Whether ``path`` is a results.nc that kvdiv wrote (its ``title`` attribute).

    Parameters
    ----------
    path : str or pathlib.Path
        Any path.

    Returns
    -------
    bool
        False for anything missing, unreadable or foreign; a symlink never counts.

    Examples
    --------
    >>> is_results("/nonexistent/results.nc")
    False
    """
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    try:
        # the root attributes alone: xarray would decode every variable's metadata first
        # (2.4 s for the demo's 269 variables, paid at every rewrite of a report)
        with h5netcdf.File(path, "r") as fh:
            return fh.attrs.get("title") == RESULTS_TITLE
    except (OSError, ValueError):
        return False

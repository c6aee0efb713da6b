"""The report's noise-floor section as display rows: the control's floor and each policy beside it.

The numbers are :func:`divstats.estimation.noise_floor.noise_floor`'s and
:func:`~divstats.estimation.noise_floor.compare_to_floor`'s; :func:`vs_floor` is the one
formatting of a value against the floor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from divstats.estimation.noise_floor import NO_CONTROL, NOISE_FLOOR_FACTOR, NOISE_FLOOR_METRICS, compare_to_floor
from divstats.report.tables import fmt, fmt_ci, unify

if TYPE_CHECKING:
    from divstats.report.analysis import Analysis

__all__ = ["floor_text", "noise_floor_rows", "noise_floor_status", "vs_floor"]


def noise_floor_status(an: Analysis) -> str:
    """The noise-floor section's first line: which control, how the floor is read, or that there is none.

    Parameters
    ----------
    an : Analysis
        A computed analysis.

    Returns
    -------
    str
        The sentence (:data:`~divstats.estimation.noise_floor.NO_CONTROL` without a control).

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "full": PolicyEffect(0.0)}, horizon=6, replicates=3)
    >>> an = compute(ds, n_resamples=99, progress=False)
    >>> noise_floor_status(an)[:16], noise_floor_status(compute(ds.sel(policy=["a"]), n_resamples=99,
    ...                                                          progress=False))[:21]
    ("The control 'ful", 'no control collected ')
    """
    nf = an.noise_floor
    if nf is None or not nf.attrs.get("control"):
        return NO_CONTROL
    return (f"The control {nf.attrs['control']!r} is the full-cache model as a candidate, run in the same requests, "
            "batches and fused forwards as the others: every divergence it shows is numerical. One noise-floor "
            "unit is its estimate + 1.96 × its standard error over documents (max TV: its largest); a policy "
            f"within {NOISE_FLOOR_FACTOR:g} units "
            "(NOISE_FLOOR_FACTOR) is flagged ⚠, since its effect cannot be told from numerics.")


def floor_text(floor: float, steps: int) -> str:
    """One noise-floor unit as the report prints it; a floor of exactly 0 said in words.

    Parameters
    ----------
    floor : float
        The floor (``floor_<metric>`` of :func:`~divstats.estimation.noise_floor.noise_floor`).
    steps : int
        The steps the control was decoded over (its ``control_steps`` attr; 0 if unknown).

    Returns
    -------
    str

    Examples
    --------
    >>> floor_text(0.0, 1920)
    'floor exactly 0 (no numerical divergence in 1,920 steps)'
    >>> floor_text(0.012, 1920)
    '0.012'
    """
    if floor == 0:
        where = f" in {steps:,} steps" if steps > 0 else ""
        return f"floor exactly 0 (no numerical divergence{where})"
    return fmt(floor)


def vs_floor(value: float, units: float, floor: float) -> str:
    """A policy's value beside the noise floor: "×floor" only where the floor is positive.

    The one formatting of a value against the floor (the report's noise-floor table; the demo's
    headline takes it from here).  A ratio to a floor of exactly 0 is infinite and says nothing, so
    the value is given with "floor exactly 0" instead.

    Parameters
    ----------
    value, units, floor : float
        :func:`~divstats.estimation.noise_floor.compare_to_floor`'s ``<m>``, ``<m>_units``, ``<m>_floor``.

    Returns
    -------
    str

    Examples
    --------
    >>> vs_floor(0.98, float("inf"), 0.0)
    '0.98 (floor exactly 0)'
    >>> vs_floor(0.3, 10.0, 0.03)
    '0.3 (10× floor)'
    """
    if floor == 0:
        return f"{fmt(value)} (floor exactly 0)"
    return f"{fmt(value)} ({fmt(units, 3)}× floor)"


def noise_floor_rows(an: Analysis) -> list[dict[str, str]]:
    """The control's floor (first row) and each policy beside it, in noise-floor units, with ⚠ where within.

    Parameters
    ----------
    an : Analysis
        A computed analysis.

    Returns
    -------
    list of dict
        ``model`` (when several), ``policy``, occurrence, max_tv, mismatch_fraction and
        ``within the floor``; empty when the traces hold no control (:func:`noise_floor_status`
        says so).

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "full": PolicyEffect(0.0)}, horizon=6, replicates=3)
    >>> an = compute(ds, n_resamples=99, progress=False)
    >>> [r["policy"] for r in noise_floor_rows(an)]
    ['full (control)', 'one floor unit', 'a']
    """
    nf = an.noise_floor
    if nf is None or not nf.attrs.get("control"):
        return []
    models = [str(m) for m in nf["model"].values] if "model" in nf.dims else [None]
    rows = []
    for m in models:
        sel = {} if m is None else {"model": m}
        row = {"model": m} if m is not None else {}
        row["policy"] = f"{nf.attrs['control']} (control)"
        for q in NOISE_FLOOR_METRICS:
            if q == "max_tv":
                row[q] = fmt(nf["aggregate_max_tv"].sel(sel))
            else:
                row[q] = (f"{fmt(nf['aggregate_' + q].sel(sel))} "
                          f"{fmt_ci(nf['aggregate_' + q + '_low'].sel(sel), nf['aggregate_' + q + '_high'].sel(sel))}")
        row["within the floor"] = "(the floor)"
        rows.append(row)
        unit = {"model": m} if m is not None else {}
        unit["policy"] = "one floor unit"
        unit.update({q: floor_text(float(nf["floor_" + q].sel(sel)), int(nf.attrs.get("control_steps", 0)))
                     for q in NOISE_FLOOR_METRICS})
        unit["within the floor"] = f"(×{NOISE_FLOOR_FACTOR:g} flags)"
        rows.append(unit)
    for r in compare_to_floor(an.aggregate, nf):
        row = {"model": r["model"]} if r["model"] is not None else {}
        row["policy"] = r["policy"]
        for q in NOISE_FLOOR_METRICS:
            row[q] = vs_floor(r[q], r[q + "_units"], r[q + "_floor"])
        row["within the floor"] = ("⚠ " + ", ".join(r["within"])) if r["within"] else ""
        rows.append(row)
    return unify(rows)

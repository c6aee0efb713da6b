"""The headline: an analysis in a few lines of plain text, as ``kvdiv demo`` prints it.

Beside the report's tables (``tables``), which format the same results as display rows
for the HTML page and ``summary.md``: this module formats them for a terminal, in
fixed-width columns at three significant digits. Three blocks, each a function of the
frozen :class:`~divstats.report.analysis.Analysis`:

- :func:`headline`: the plan table per model (one line per hypothesis), the chosen
  estimands per policy over all documents, and the noise floor;
- :func:`certify_headline`: the certified budget per method (and model), in words;
- :func:`speculative_headline`: tokens per target call per draft and γ.

The digits are the demo's since its first run (``tests/test_demo_headline.py`` pins them
byte for byte); :func:`divstats.report.tables.fmt` is the report's own format (four
digits, a dash for NaN) and is kept apart on purpose.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
import xarray as xr

from divstats.estimands import TOKENS_PER_CALL

if TYPE_CHECKING:
    from divstats.report.analysis import Analysis

__all__ = ["certify_headline", "headline", "speculative_headline"]


def headline(an: Analysis, quantities: Sequence[str]) -> str:
    """The plan table, one block per model (one line per hypothesis), plus each model's
    ``quantities`` per policy and its noise floor.

    Parameters
    ----------
    an : Analysis
        An analysis with a plan (``an.plan_result``).
    quantities : sequence of str
        Aggregate estimands shown per policy (those ``an.aggregate`` lacks are left out).

    Returns
    -------
    str
        The block, without a trailing newline.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> table = pd.DataFrame([dict(id="H1", a="snapkv@0.5", b="recent@0.5", policy="", n_docs=5, mean_a=0.41,
    ...                            mean_b=0.3, effect=0.11, p_adjusted=0.031, reject=True, label="confirmatory")])
    >>> agg = xr.Dataset({"occurrence": ("policy", [0.41, 0.3])}, coords={"policy": ["snapkv@0.5", "recent@0.5"]})
    >>> an = NS(plan=NS(name="demo", sha256="0" * 64), plan_result=NS(table=table), aggregate=agg, noise_floor=None)
    >>> print(headline(an, ["occurrence"]))
    plan demo (sha256 000000000000…)
    5 confirmatory docs
      hypothesis         A − B                                mean A   mean B   effect  p (Holm)  reject  label
      H1                 snapkv@0.5 − recent@0.5                0.41      0.3     0.11     0.031  yes     confirmatory
    <BLANKLINE>
      policy          occurrence   (all docs, descriptive)
      snapkv@0.5            0.41
      recent@0.5             0.3
    <BLANKLINE>
      noise floor: no control collected
    """
    table = an.plan_result.table
    agg = an.aggregate
    models = [str(m) for m in agg["model"].values] if "model" in agg.dims else [None]
    lines = [f"plan {an.plan.name} (sha256 {an.plan.sha256[:12]}…)"
             + (f", Holm within each family over {len(models)} models" if len(models) > 1 else "")]
    for model in models:
        rows = table if model is None else table[table["model"] == model]
        n_docs = int(rows["n_docs"].max()) if len(rows) else 0
        lines.append(("" if model is None else f"\n  model {model}: ") + f"{n_docs} confirmatory docs")
        lines += _plan_lines(rows)
        lines += _policy_lines(an, agg if model is None else agg.sel(model=model), quantities)
        lines.append(_floor_line(an, model))
    return "\n".join(lines)


def _plan_lines(rows: pd.DataFrame) -> list[str]:
    lines = [f"  {'hypothesis':<18} {'A − B':<34} {'mean A':>8} {'mean B':>8} {'effect':>8} "
             f"{'p (Holm)':>9}  reject  label"]
    for r in rows.itertuples(index=False):
        comp = f"{r.a} − {r.b}" + (f" ({r.policy})" if r.policy else "")
        hid = r.id.split("[")[0]     # the model is the block's
        lines.append(f"  {hid:<18} {comp:<34} {_num(r.mean_a):>8} {_num(r.mean_b):>8} {_num(r.effect):>8} "
                     f"{_num(r.p_adjusted):>9}  {'yes' if r.reject else 'no':<6}  {r.label}")
    return lines


def _policy_lines(an: Analysis, agg: xr.Dataset, quantities: Sequence[str]) -> list[str]:
    """One model's ``quantities`` per policy, over all documents (descriptive)."""
    shown = [q for q in quantities if q in agg.data_vars]
    if not shown:
        return []
    lines = ["", f"  {'policy':<14}" + "".join(f"{q:>12}" for q in shown) + "   (all docs, descriptive)"]
    for pol in agg["policy"].values:
        lines.append(f"  {str(pol):<14}" + "".join(f"{_num(float(agg[q].sel(policy=pol))):>12}" for q in shown)
                     + ("   (control: the noise floor)" if pol == _control(an) else ""))
    return lines


def _control(an: Analysis) -> str | None:
    floor = getattr(an, "noise_floor", None)
    return (floor.attrs.get("control") or None) if floor is not None else None


def _floor_line(an: Analysis, model: str | None = None) -> str:
    """The noise floor in one line (one model's): the control's occurrence and max TV, or that none was collected."""
    floor = getattr(an, "noise_floor", None)
    if floor is None or not floor.attrs.get("control"):
        return "\n  noise floor: no control collected"
    if "model" in floor.dims:
        if model is None:
            return f"\n  noise floor ({floor.attrs['control']} vs full): per model, see the report"
        floor = floor.sel(model=model)
    return (f"\n  noise floor ({floor.attrs['control']} vs full): occurrence "
            f"{_num(float(floor['aggregate_occurrence']))}, max TV {float(floor['aggregate_max_tv']):.3g}")


def _num(x: Any) -> str:
    """Three significant digits, ``nan`` as such (a terminal's column, not the report's :func:`~.tables.fmt`)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "nan" if math.isnan(v) else f"{v:.3g}"


def certify_headline(an: Analysis) -> str:
    """The certified budget per method (and model), in words.

    Parameters
    ----------
    an : Analysis
        An analysis whose plan may hold ``[[certify]]`` tables.

    Returns
    -------
    str
        A block starting with a newline, or ``""`` when nothing was certified or refused.
        When every certification shares its metric and margin they are said once in the
        block's first line, else on each line.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> cert = pd.DataFrame([dict(family="snapkv", model=None, metric="mismatch_fraction", margin=0.05, alpha=0.05,
    ...                           certified="snapkv@0.5", certified_kept=0.5, reason="")])
    >>> print(certify_headline(NS(plan_result=NS(certify=cert))))
    <BLANKLINE>
      How much can I compress? (mismatch_fraction within 0.05 of the full model, fixed-sequence, α = 0.05):
      snapkv                   certified down to snapkv@0.5 (KV kept 0.5)
    """
    pr = getattr(an, "plan_result", None)
    if pr is None or not len(pr.certify):
        return ""
    cert = pr.certify
    shared = cert["metric"].nunique() == 1 and cert["margin"].nunique() == 1
    what = f"{cert['metric'].iloc[0]} within {float(cert['margin'].iloc[0]):g} of the full model, " if shared else ""
    lines = [f"\n  How much can I compress? ({what}fixed-sequence, α = {float(cert['alpha'].iloc[0]):g}):"]
    for r in cert.itertuples(index=False):
        who = f"{r.family}" + ("" if r.model is None else f" [{r.model}]")
        said = (f"certified down to {r.certified} (KV kept {_num(r.certified_kept)})" if r.certified
                else f"none certified — {r.reason}")
        if not shared:
            said += f" ({r.metric} within {float(r.margin):g})"
        lines.append(f"  {who:<24} {said}")
    return "\n".join(lines)


def speculative_headline(an: Analysis) -> str:
    """Tokens per target call per draft policy at each γ, with the interval over documents
    when there are enough of them (else ± the Monte Carlo standard error).

    Parameters
    ----------
    an : Analysis
        An analysis of reference traces (``an.speculative``).

    Returns
    -------
    str
        A block starting with a newline, one table per model.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> cells = {"": [[1.6, 2.1]], "_low": [[1.5, 1.9]], "_high": [[1.7, float("inf")]], "_se": [[0.05, 0.1]]}
    >>> spec = xr.Dataset({f"tokens_per_call{k}": (("policy", "gamma"), v) for k, v in cells.items()},
    ...                   coords={"policy": ["snapkv@0.5"], "gamma": [1, 2]}).assign(n_docs=10)
    >>> for line in speculative_headline(NS(speculative=spec)).splitlines()[2:]:
    ...     print(line)
      draft                      γ = 1               γ = 2
      snapkv@0.5     1.60 [1.50, 1.70]         2.10 ± 0.10
    """
    spec = an.speculative
    gammas = [int(g) for g in spec["gamma"].values]
    lines = ["", f"  speculative decoding with the evicted model as draft ({int(spec['n_docs'].max())} docs): "
             "tokens per target call, 95% interval over documents"]
    models = [str(m) for m in spec["model"].values] if "model" in spec.dims else [None]
    for model in models:
        one = spec if model is None else spec.sel(model=model)
        if model is not None:
            lines.append(f"  model {model}")
        lines += _speculative_rows(one, gammas)
    return "\n".join(lines)


def _speculative_rows(spec: xr.Dataset, gammas: list[int]) -> list[str]:
    lines = [f"  {'draft':<12}" + "".join(f"{'γ = ' + str(g):>20}" for g in gammas)]
    for pol in spec["policy"].values:
        cells = []
        for g in gammas:
            c = spec.sel(policy=pol, gamma=g)
            lo, hi = float(c[f"{TOKENS_PER_CALL}_low"]), float(c[f"{TOKENS_PER_CALL}_high"])
            band = f"[{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else \
                f"± {float(c[f'{TOKENS_PER_CALL}_se']):.2f}"
            cells.append(f"{float(c[TOKENS_PER_CALL]):.2f} {band}")
        lines.append(f"  {str(pol):<12}" + "".join(f"{x:>20}" for x in cells))
    return lines

"""The report's "Does it change the answer?" section: display rows, figures and the plain-text table.

:func:`answers_context` is what the template's section reads, :func:`make_answer_figures`
its figures (the needle-depth map, accuracy against budget), and :func:`answers_text_table`
the per-policy answers table as plain text (the demo's headline).  The numbers come from
:func:`divstats.report.answers.compute_answers`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from divstats.estimation.token_summary import TOKEN_SUMMARIES
from divstats.report.answers import AnswerAnalysis
from divstats.report.figures import compression_figure
from divstats.report.tables import fmt, fmt_p, unify

__all__ = ["answers_context", "answers_text_table", "make_answer_figures"]


# --------------------------------------------------------------------------- display rows

def _fmt(x: Any, digits: int = 3) -> str:
    return fmt(x, digits)


def _pct(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{100 * x:.1f}%"


def _ci(lo: float, hi: float, pct: bool = False) -> str:
    f = _pct if pct else _fmt
    return "[—]" if not (np.isfinite(lo) and np.isfinite(hi)) else f"[{f(lo)}, {f(hi)}]"


def _cells(ds: xr.Dataset) -> list[tuple[str, dict[str, Any]]]:
    """(label, selection) for every policy (and model) of a per-policy dataset."""
    if "model" in ds.dims:
        return [(f"{p} [{m}]", {"policy": p, "model": m}) for m in ds["model"].values for p in ds["policy"].values]
    return [(str(p), {"policy": p}) for p in ds["policy"].values]


def answer_rows(aa: AnswerAnalysis | None) -> list[dict[str, str]]:
    """Per policy: P's and Q's accuracy, Q − P with its interval, the test's p, lost and gained.

    Parameters
    ----------
    aa : AnswerAnalysis or None
        :func:`compute_answers` output.

    Returns
    -------
    list of dict
        Display rows (empty without answers).
    """
    if aa is None or not aa.has_answers:
        return []
    t = aa.table
    rows = []
    for label, sel in _cells(t):
        c = t.sel(sel)
        v = {k: float(c[k]) for k in t.data_vars if k != "answer_test"}
        rows.append({
            "policy": label, "documents": str(int(v["answer_n_docs"])),
            "P accuracy": f"{_pct(v['answer_x_accuracy'])} {_ci(v['answer_x_accuracy_low'], v['answer_x_accuracy_high'], True)}",  # noqa: E501
            "Q accuracy": f"{_pct(v['answer_y_accuracy'])} {_ci(v['answer_y_accuracy_low'], v['answer_y_accuracy_high'], True)}",  # noqa: E501
            "Q − P": f"{_signed_pct(v['answer_difference'])} "
                     f"{_ci(100 * v['answer_difference_low'], 100 * v['answer_difference_high'])}",
            "p (no change)": _p(v["answer_mcnemar_p"]), "test": _SHORT_TEST.get(str(c["answer_test"].values), "—"),
            "lost": str(int(v["answer_lost"])), "gained": str(int(v["answer_gained"])),
        })
    return rows


_SHORT_TEST = {"mcnemar-exact": "McNemar exact", "sign-flip permutation over documents": "sign-flip, documents"}


def _signed_pct(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{100 * x:+.1f}".replace("-", "−") + " pts"


def _p(p: float) -> str:
    return fmt_p(p)


def certify_rows(aa: AnswerAnalysis | None) -> list[dict[str, str]]:
    """Per policy family: the budgets tested for accuracy within the margin and the certified one."""
    if aa is None:
        return []
    rows = []
    for fam, m, res in aa.certify:
        rows.append({"family": fam + (f" [{m}]" if m is not None else ""),
                     "budgets (most KV first)": ", ".join(res.budgets),
                     "Q − P by budget": ", ".join(_signed_pct(e) for e in res.estimate),
                     "tested": str(res.tested), "certified": res.certified or "none", "verdict": res.verdict})
    return rows


_WHERE = {"before": "diverged before the answer", "inside": "diverged inside the answer",
          "diverged": "diverged (answer start unknown)", "none": "no mismatch in the trace"}


def change_rows(aa: AnswerAnalysis | None) -> list[dict[str, str]]:
    """Per policy: how often the answer changed when P and Q diverged before the answer, inside it, not at all."""
    if aa is None or not aa.change.data_vars:
        return []
    ch = aa.change
    rows = []
    for label, sel in _cells(ch):
        c = ch.sel(sel)
        row = {"policy": label}
        for where in [str(w) for w in ch["divergence"].values]:
            n = int(c["answer_change_pairs"].sel(divergence=where))
            if where == "diverged" and n == 0:
                continue
            s = float(c["answer_score_changed"].sel(divergence=where))
            tx = float(c["answer_text_changed"].sel(divergence=where))
            text = "" if not np.isfinite(tx) else f", text {_pct(tx)}"
            row[_WHERE[where]] = "—" if n == 0 else f"{n} pairs: score {_pct(s)}{text}"
        rows.append(row)
    return unify(rows)


def saving_rows(aa: AnswerAnalysis | None) -> list[dict[str, str]]:
    """Per policy: the paired difference's variance coupled vs independent and the documents each needs."""
    if aa is None or not aa.has_answers:
        return []
    t = aa.table
    m = float(t.attrs.get("coupling_margin", math.nan))
    rows = []
    for label, sel in _cells(t):
        c = t.sel(sel)
        v = {k: float(c[k]) for k in ("answer_var_within_coupled", "answer_var_within_independent",
                                      "answer_var_docs_coupled", "answer_var_docs_independent",
                                      "answer_docs_needed_coupled", "answer_docs_needed_independent")}
        nc, ni = v["answer_docs_needed_coupled"], v["answer_docs_needed_independent"]
        rows.append({"policy": label,
                     "within-doc var (coupled / independent)":
                         f"{_fmt(v['answer_var_within_coupled'])} / {_fmt(v['answer_var_within_independent'])}",
                     "across-doc var (coupled / independent)":
                         f"{_fmt(v['answer_var_docs_coupled'])} / {_fmt(v['answer_var_docs_independent'])}",
                     f"docs for ±{100 * m:g} pts (coupled / independent)": f"{_fmt(nc)} / {_fmt(ni)}",
                     "saved": "—" if not (np.isfinite(nc) and np.isfinite(ni) and ni > 0) else _pct(1 - nc / ni)})
    return rows


def token_rows(aa: AnswerAnalysis | None) -> list[dict[str, str]]:
    """Per policy: KL(P‖Q) per token (mean, q90, q99), top-1 agreement and the greedy flip rate, with intervals."""
    if aa is None or not aa.tokens.data_vars:
        return []
    ts = aa.tokens
    rows = []
    heads = {"token_kl_mean": "KL mean (nats)", "token_kl_q90": "KL q90", "token_kl_q99": "KL q99",
             "token_top1_agreement": "top-1 agreement", "token_flip_rate": "greedy flip rate"}
    for label, sel in _cells(ts):
        c = ts.sel(sel)
        row = {"policy": label, "documents": str(int(c["token_n_docs"])),
               "scored steps": str(int(c["token_n_tokens"]))}
        for k in TOKEN_SUMMARIES:
            pct = k in ("token_top1_agreement", "token_flip_rate")
            est = float(c[k])
            row[heads[k]] = f"{_pct(est) if pct else _fmt(est)} {_ci(float(c[k + '_low']), float(c[k + '_high']), pct)}"
        rows.append(row)
    return rows


def answers_context(aa: AnswerAnalysis | None) -> dict[str, Any]:
    """What the template's "Does it change the answer?" section reads (empty dict: no section).

    Parameters
    ----------
    aa : AnswerAnalysis or None
        :func:`compute_answers` output.

    Returns
    -------
    dict
        ``rows``, ``certify``, ``change``, ``saving``, ``per_token`` (display rows), ``margin``
        (in points), ``replicates`` (pairs per document), ``has_answers`` and ``depth``.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> from divstats.truth.answers import with_answer_scores
    >>> tr = with_answer_scores(simulate_study(12, {"a@0.5": PolicyEffect(0.3)}, horizon=6, replicates=2),
    ...                         {"a@0.5": (0.5, 0.0)})
    >>> import divstats
    >>> from divstats.report.answers import compute_answers
    >>> ctx = answers_context(compute_answers(tr, divstats.answer_values(tr), n_resamples=99))
    >>> ctx["rows"][0]["policy"], ctx["margin"]
    ('a@0.5', '5')
    """
    if aa is None:
        return {}
    reps = int(aa.table["answer_pairs"].max() / max(aa.table["answer_n_docs"].max(), 1)) if aa.has_answers else 0
    return {"rows": answer_rows(aa), "certify": certify_rows(aa), "change": change_rows(aa),
            "saving": saving_rows(aa), "per_token": token_rows(aa), "margin": f"{100 * aa.margin:g}",
            "replicates": reps, "has_answers": aa.has_answers, "depth": bool(aa.depth.data_vars)}


def make_answer_figures(aa: AnswerAnalysis | None) -> dict[str, Figure]:
    """``answers_depth`` (needle tasks) and ``answers_budget`` (policy families) when there is something to show.

    Parameters
    ----------
    aa : AnswerAnalysis or None
        :func:`divstats.report.answers.compute_answers` output.

    Returns
    -------
    dict of str to matplotlib.figure.Figure

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> from divstats.truth.answers import with_answer_scores
    >>> tr = with_answer_scores(simulate_study(12, {"a@0.5": PolicyEffect(0.3)}, horizon=6, replicates=2),
    ...                         {"a@0.5": (0.5, 0.0)})
    >>> import divstats
    >>> from divstats.report.answers import compute_answers
    >>> sorted(make_answer_figures(compute_answers(tr, divstats.answer_values(tr), n_resamples=99)))
    ['answers_depth']
    """
    figs: dict[str, Any] = {}
    fig = depth_figure(aa)
    if fig is not None:
        figs["answers_depth"] = fig
    if aa is not None and aa.curves is not None:
        certified = {(fam, m): res.certified or "" for fam, m, res in aa.certify}
        fig = compression_figure(aa.curves, certified)
        for ax in fig.axes:
            ax.set_title("Q's accuracy against KV kept (dashed: P's accuracy − margin)")
        figs["answers_budget"] = fig
    return figs


# --------------------------------------------------------------------------- figures and results

def depth_figure(aa: AnswerAnalysis | None) -> Figure | None:
    """Needle tasks: Q's accuracy by needle depth x policy (and P's, as the top row), as a heat map."""
    if aa is None or not aa.depth.data_vars:
        return None
    d = aa.depth
    if "model" in d.dims:
        d = d.isel(model=0)
    pols = [str(p) for p in d["policy"].values]
    grid = np.vstack([d["answer_depth_x_accuracy"].mean("policy").values[None, :],
                      d["answer_depth_y_accuracy"].transpose("policy", "depth").values])
    labels = ["P (full)"] + pols
    fig = Figure(figsize=(6.8, 0.9 + 0.45 * len(labels)), layout="constrained")
    FigureCanvasAgg(fig)       # headless, and the global backend is left alone
    ax = fig.subplots()
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_yticks(range(len(labels)), labels)
    lows, highs = d["depth_low"].values, d["depth_high"].values
    ax.set_xticks(range(len(lows)), [f"{lo:.1f}–{hi:.1f}" for lo, hi in zip(lows, highs, strict=True)])
    ax.set_xlabel("needle depth (fraction of the context)")
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy (share of answers right)")
    ax.set_title("accuracy by needle depth")
    return fig


def answers_text_table(table: xr.Dataset) -> str:
    """The per-policy answers table as plain text (the demo's headline).

    Parameters
    ----------
    table : xarray.Dataset
        :func:`divstats.compare_answers_dataset` output (or a results.nc holding its variables).

    Returns
    -------
    str
        One line per policy: P and Q accuracy, Q − P with its interval, the test's p, lost/gained.

    Examples
    --------
    >>> import numpy as np, xarray as xr
    >>> from divstats.inference.answers import compare_answers_dataset
    >>> x = xr.DataArray(np.ones((12, 1, 1)), dims=("doc", "policy", "replicate"), coords={"policy": ["a"]})
    >>> print(answers_text_table(compare_answers_dataset(xr.Dataset({"x_score": x, "y_score": x * 0}))))
    policy  docs  P acc   Q acc  Q - P [95% interval]         p (test)                  lost/gained
    a         12  100.0%   0.0%  -100.0 pts [-100.0, -100.0]  4.88e-04 (mcnemar-exact)  12/0
    """
    level = float(table.attrs.get("level", 0.95))
    head = ["policy", "docs", "P acc", "Q acc", f"Q - P [{100 * level:g}% interval]", "p (test)", "lost/gained"]
    rows = []
    for label, sel in _cells(table):
        c = table.sel(sel)
        f = {k: float(c[k]) for k in table.data_vars if k != "answer_test"}
        lo, hi = f["answer_difference_low"], f["answer_difference_high"]
        ci = "[—]" if not (np.isfinite(lo) and np.isfinite(hi)) else f"[{100 * lo:.1f}, {100 * hi:.1f}]"
        diff = "—" if not np.isfinite(f["answer_difference"]) else f"{100 * f['answer_difference']:+.1f} pts"
        p = f["answer_mcnemar_p"]
        rows.append([label, str(int(f["answer_n_docs"])), _pct_plain(f["answer_x_accuracy"]),
                     _pct_plain(f["answer_y_accuracy"]), f"{diff} {ci}",
                     ("—" if not np.isfinite(p) else (f"{p:.2e}" if p < 1e-3 else f"{p:.4f}"))
                     + f" ({c['answer_test'].values})", f"{int(f['answer_lost'])}/{int(f['answer_gained'])}"])
    return _columns(head, rows)


def _pct_plain(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{100 * x:.1f}%"


def _columns(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    right = {1, 2, 3}
    lines = []
    for r in [head, *rows]:
        cells = [c.rjust(w) if i in right and r is not head else c.ljust(w) for i, (c, w) in
                 enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)

"""The demo's pass-key set: does compression change the answer? (docs/collector.md, "The demo").

Beside the drift of the main study, the demo asks SmolLM2 for pass keys: the ``passkey``
trace set of ``kvdiv.demo_spec.DEMO_STUDY`` (30 RULER-style ``passkey`` documents near 500
tokens, the needle depths spread evenly; ``coupled`` traces, greedy as the leaderboards,
R = 1, T = 12, long enough to finish the answer; ``snapkv@0.5``, ``recent@0.5``,
``snapkv@0.3`` and the control ``full``). The collector decodes P's and each Q's answer
and ``kvdiv pack`` scores them (``x_score``, ``y_score``). This module analyses the set
into its own report (``passkey/``, with its "Does it change the answer?" section) and
prints the answers table after the main headline.

The table's statistics are divstats' (``compare_answers_dataset``: the paired
difference with its interval over documents, McNemar's exact test, the flips).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["analyse", "answers_headline", "footer", "headline"]


def analyse(cfg: Any, traces: Path) -> tuple[Any, Any]:
    """The pass-key set's own report (``passkey/`` under the demo's folder) and its traces.

    Parameters
    ----------
    cfg : kvdiv.demo_spec.DemoConfig
        The demo's settings (output folder, seed, resamples).
    traces : Path
        The packed pass-key traces.

    Returns
    -------
    (Analysis, xarray.Dataset)
        divstats' analysis (descriptive: no plan) and the traces, loaded.

    Raises
    ------
    DivstatsError
        Traces divstats cannot analyse.
    """
    import protocols
    from divstats import analyze

    an = analyze(traces, None, Path(cfg.out) / "passkey", seed=cfg.seed, n_resamples=cfg.n_resamples,
                 progress=False)
    return an, protocols.open_traces(traces).load()


def headline(result: tuple[Any, Any]) -> str:
    """The answers table printed after the main headline (:func:`answers_headline`)."""
    return answers_headline(result[1])


def footer(result: tuple[Any, Any], traces: Path) -> str:
    """Where the pass-key report and traces are."""
    return f"pass keys: {result[0].paths['report.html']}   pass-key traces: {traces}"


def answers_headline(ds: Any, *, seed: int = 0) -> str:
    """The printed answers table: per policy P's and Q's accuracy, Q − P with its 95% interval
    over documents, the test's p (McNemar's exact test on greedy 0/1 answers) and lost/gained.

    The numbers are ``divstats.compare_answers_dataset``'s, laid out by
    ``divstats.answers_text_table`` (docs/statistics.md §12).

    Parameters
    ----------
    ds : xarray.Dataset
        The pass-key traces (with ``x_score`` and ``y_score``).
    seed : int
        Seeds the permutation test where McNemar's does not apply.

    Returns
    -------
    str
        A title line and the table, indented for the headline.

    Raises
    ------
    DivstatsError
        Traces without scores.
    """
    from divstats import answers_text_table, compare_answers_dataset

    table = compare_answers_dataset(ds, seed=seed)
    title = (f"  does it change the answer? {ds.sizes['doc']} pass-key documents, "
             f"{'greedy' if _greedy(ds) else 'sampled'}; P = the full model, Q = the policy; "
             "lost: P right and Q wrong, gained: the reverse")
    return "\n".join(["", title, *("  " + line for line in answers_text_table(table).splitlines())])


def _greedy(ds: Any) -> bool:
    from protocols import sampling_params

    return float(sampling_params(ds).get("temperature", 1.0)) == 0.0

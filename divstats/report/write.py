"""``analyze``: compute an analysis and write its report files, never destroying what kvdiv did not write.

Three files make a report:

* ``report.html`` — self-contained (figures embedded as base64 PNG), see
  :mod:`divstats.report.render` and docs/report.md;
* ``summary.md`` — the same headline numbers as Markdown;
* ``results.nc`` — every number as one xarray Dataset (:mod:`divstats.report.results`).

Two ways to write them:

* :func:`write_report` (and :func:`analyze`, the Python entry point) writes the
  files into a directory that may hold other files (``kvdiv demo`` keeps its
  traces there). Each file goes to a temporary sibling and is renamed into place;
  an existing file is replaced only if kvdiv wrote it, and never through a symlink.
* :func:`publish_report` (``kvdiv analyze --out DIR``) treats DIR as the output:
  it is built as a temporary sibling directory and renamed into place. An existing
  DIR is refused unless ``overwrite``, and even then replaced only if it holds
  nothing but a report kvdiv wrote; a symlink is never followed.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import xarray as xr

from divstats.errors import OutputError
from divstats.plans.format import PlanSource
from divstats.report.analysis import Analysis, compute
from divstats.report.render import SUMMARY_HEADING, figure_png, make_figures, render_html, render_markdown
from divstats.report.results import is_results, results_dataset, save_results
from protocols import open_traces

__all__ = ["OUTPUT_FILES", "analyze", "check_publishable", "is_report_dir", "publish_report", "write_report"]

#: The files of a report, in the order they are written.
OUTPUT_FILES: tuple[str, ...] = ("report.html", "summary.md", "results.nc")
_HTML_MARK = b"<title>kvdiv report"


def _is_own_file(path: Path) -> bool:
    """Whether ``path`` is a report file kvdiv wrote (recognised by its content)."""
    if path.is_symlink() or not path.is_file():
        return False
    if path.name == "results.nc":
        return is_results(path)
    with path.open("rb") as fh:
        head = fh.read(4096)
    if path.name == "report.html":
        return _HTML_MARK in head
    return head.startswith(SUMMARY_HEADING.encode())


def _atomic_write(target: Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary sibling of ``target``, then rename it over ``target``.

    The temporary name is chosen, not created: ``write`` creates the file, so it gets the
    process umask's permissions like any other output (``tempfile.mkstemp`` made every
    report file 0600, unreadable by the group whatever the umask said).
    """
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _check_dir(out: Path) -> None:
    if out.is_symlink():
        raise OutputError(f"{out} is a symlink; kvdiv never writes through one (give the real directory)")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory")


def write_report(an: Analysis, out_dir: str | Path) -> dict[str, Path]:
    """Write report.html, summary.md and results.nc into ``out_dir`` (created if needed).

    Other files in ``out_dir`` are left alone. Each output is written to a
    temporary sibling and renamed into place, so a reader never sees half a file.

    Parameters
    ----------
    an : Analysis
        A computed analysis (``divstats.report.analysis.compute``).
    out_dir : str or pathlib.Path
        The directory.

    Returns
    -------
    dict of str to pathlib.Path
        File name → path written.

    Raises
    ------
    OutputError
        If ``out_dir`` or an output path is a symlink, or an output path holds a
        file kvdiv did not write (nothing is written then).

    Examples
    --------
    >>> import tempfile
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> sorted(write_report(compute(ds, n_resamples=99, progress=False), tempfile.mkdtemp()))
    ['report.html', 'results.nc', 'summary.md']
    """
    out = Path(out_dir)
    _check_dir(out)
    for name in OUTPUT_FILES:
        target = out / name
        if target.is_symlink():
            raise OutputError(f"{target} is a symlink; kvdiv never writes through one")
        if target.exists() and not _is_own_file(target):
            raise OutputError(f"{target} exists and was not written by kvdiv analyze; not replacing it")
    out.mkdir(parents=True, exist_ok=True)
    pngs = {k: figure_png(f) for k, f in make_figures(an).items()}
    html, md = render_html(an, pngs), render_markdown(an)
    results = results_dataset(an)
    paths = {"report.html": _atomic_write(out / "report.html", lambda p: p.write_text(html, encoding="utf-8")),
             "summary.md": _atomic_write(out / "summary.md", lambda p: p.write_text(md, encoding="utf-8")),
             "results.nc": _atomic_write(out / "results.nc", lambda p: save_results(results, p))}
    return paths


def is_report_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding nothing but a report kvdiv wrote.

    Parameters
    ----------
    path : str or pathlib.Path
        Any path.

    Returns
    -------
    bool
        True only for a real directory (not a symlink) whose entries are all
        :data:`OUTPUT_FILES`, each recognisably kvdiv's, results.nc among them.

    Examples
    --------
    >>> import tempfile
    >>> is_report_dir(tempfile.mkdtemp())
    False
    """
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    entries = list(path.iterdir())
    return (any(e.name == "results.nc" for e in entries)
            and all(e.name in OUTPUT_FILES and _is_own_file(e) for e in entries))


def check_publishable(out_dir: str | Path, overwrite: bool = False) -> None:
    """Refuse an ``out_dir`` that :func:`publish_report` must not replace.

    Parameters
    ----------
    out_dir : str or pathlib.Path
        The intended output directory.
    overwrite : bool
        Whether replacing an earlier report is allowed.

    Raises
    ------
    OutputError
        If ``out_dir`` is a symlink or a file, is a non-empty directory and
        ``overwrite`` is false, or holds anything but a report kvdiv wrote.

    Examples
    --------
    >>> import tempfile
    >>> check_publishable(tempfile.mkdtemp() + "/new")
    """
    out = Path(out_dir)
    _check_dir(out)
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise OutputError(f"{out} already exists; pass --overwrite to replace a report kvdiv wrote there, "
                          "or choose a new --out")
    if not is_report_dir(out):
        raise OutputError(f"{out} exists and is not (only) a report kvdiv wrote: it holds "
                          f"{sorted(e.name for e in out.iterdir())[:8]}; refusing to replace it even with "
                          "--overwrite")


def publish_report(an: Analysis, out_dir: str | Path, *, overwrite: bool = False) -> dict[str, Path]:
    """Write the report as the directory ``out_dir``: built beside it, then renamed into place.

    Parameters
    ----------
    an : Analysis
        A computed analysis.
    out_dir : str or pathlib.Path
        The output directory. It may be absent or empty; an existing non-empty one
        is replaced only with ``overwrite`` and only if :func:`is_report_dir`.
    overwrite : bool
        Allow replacing an earlier report.

    Returns
    -------
    dict of str to pathlib.Path
        File name → final path.

    Raises
    ------
    OutputError
        If ``out_dir`` is a symlink or a file, exists without ``overwrite``, or holds
        anything kvdiv did not write. Nothing is written or removed then.

    Examples
    --------
    >>> import tempfile
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> an = compute(ds, n_resamples=99, progress=False)
    >>> out = tempfile.mkdtemp() + "/report"
    >>> _ = publish_report(an, out); is_report_dir(out)
    True
    """
    out = Path(out_dir)
    check_publishable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(4)
    tmp, old = out.parent / f".{out.name}.tmp-{tag}", out.parent / f".{out.name}.old-{tag}"
    try:
        write_report(an, tmp)
        if out.exists():
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            if old.exists():
                os.rename(old, out)  # put the previous report back
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return {name: out / name for name in OUTPUT_FILES}


def analyze(traces: str | Path | xr.Dataset, plan: PlanSource | None, out_dir: str | Path, *,
            window: int | None = None, policy_aliases: Mapping[str, str] | None = None,
            seed: int = 0, n_resamples: int = 9999, level: float = 0.95,
            interval_windows: Sequence[int] | None = None, progress: bool = True,
            cost_ratio: float | None = None) -> Analysis:
    """Analyse a traces file (or dataset) under a plan; write report.html, summary.md, results.nc.

    Parameters
    ----------
    traces : str, pathlib.Path or xarray.Dataset
        A traces file (opened with ``protocols.open_traces``) or dataset.
    plan : Plan, str, pathlib.Path, mapping or None
        The plan (``"paper"``: the shipped one); None writes a descriptive report
        in which every comparison is exploratory.
    out_dir : str or pathlib.Path
        Where the three files go (see :func:`write_report`).
    window, policy_aliases, seed, n_resamples, level, interval_windows, progress, cost_ratio
        As :func:`divstats.report.analysis.compute`. ``policy_aliases`` substitutes data
        policies for planned ones (a recorded deviation; see docs/plans.md).

    Returns
    -------
    Analysis
        Every intermediate result; ``paths`` names the files written (a copy of
        :func:`divstats.report.analysis.compute`'s frozen analysis with them filled in).

    Raises
    ------
    PlanError
        For an ill-formed plan or one the data cannot serve.
    OutputError
        When an output path is a symlink or holds a file kvdiv did not write.

    Examples
    --------
    >>> import tempfile
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> an = analyze(ds, None, tempfile.mkdtemp(), n_resamples=99, progress=False)
    >>> sorted(an.paths)
    ['report.html', 'results.nc', 'summary.md']
    """
    if isinstance(traces, xr.Dataset):
        ds = traces
    else:
        ds = open_traces(traces)
    an = compute(ds, plan, window=window, policy_aliases=policy_aliases, seed=seed, n_resamples=n_resamples,
                 level=level, interval_windows=interval_windows, progress=progress, cost_ratio=cost_ratio)
    return dataclasses.replace(an, paths=write_report(an, out_dir))

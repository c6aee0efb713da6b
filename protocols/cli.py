"""``kvdiv validate`` and ``kvdiv info``: check and summarise trace files.

Imports only protocols, numpy, xarray and click (never torch, divstats or
gen_service), so both commands start quickly anywhere.
"""

from __future__ import annotations

import math
from pathlib import Path

import click
import xarray as xr

from protocols.assemble import StreamError, assemble
from protocols.chunks import cluster_options, dask_client, read_chunks
from protocols.io import CONVERTIBLE, SUFFIXES, not_a_trace_file, open_traces
from protocols.kinds import Kind
from protocols.schema import eos_ids
from protocols.validate import TraceValidationError
from protocols.validate import validate as _validate

__all__ = ["STREAM_SUFFIXES", "info", "validate"]

STREAM_SUFFIXES = (".ndjson",)   # a journal request file; .jsonl is left to eval logs


def _load(path: Path, chunks: int | str | None = None) -> xr.Dataset:
    """A dataset from a trace file (unvalidated) or from one recorded wire stream (assembled)."""
    suffix = path.suffix.lower()
    if suffix in STREAM_SUFFIXES:
        return assemble(path.read_bytes())
    if suffix in CONVERTIBLE or (path.is_dir() and suffix not in SUFFIXES):
        # an input from elsewhere: point at `kvdiv convert` (the callers name the file themselves)
        raise ValueError(not_a_trace_file(path).split(": ", 1)[1])
    if suffix not in SUFFIXES:
        raise click.BadParameter(f"{path.name}: unknown extension {path.suffix!r}; expected one of "
                                 f"{SUFFIXES + STREAM_SUFFIXES}", param_hint="PATH")
    return open_traces(path, validate=False, chunks=chunks)


def _shape(ds: xr.Dataset) -> str:
    parts = [f"{ds.sizes['model']} models"] if "model" in ds.dims else []
    parts += [f"{ds.sizes.get('doc', 0)} docs", f"{ds.sizes.get('policy', 0)} policies",
              f"{ds.sizes.get('replicate', 0)} replicates"]
    if ds.attrs.get("kind") != Kind.ANSWERS:   # scores without tokens have no horizon
        parts.append(f"T={ds.attrs.get('horizon', '?')}")
    text = " × ".join(parts)
    if ds.attrs.get("kind") == Kind.RESIDUAL:
        text += f", W={ds.attrs.get('window', '?')}"
    return text


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(exists=True, dir_okay=True, path_type=Path))
@cluster_options
def validate(path: Path, workers: int | None, scheduler: str | None, chunk_docs: int | None) -> None:
    """Check the trace file PATH against the kvdiv.trace/1 contract.

    PATH is a .nc or .zarr dataset, or one recorded wire stream (.ndjson, e.g. a
    collector journal request), which is assembled first (order, shapes, sha256).
    Exits 0 with a one-line summary when valid; exits 1 listing every problem.
    \f
    Parameters
    ----------
    path : pathlib.Path
        The file to check.

    Returns
    -------
    None
        Prints ``ok: <kind>, <sizes>`` on success.

    Raises
    ------
    SystemExit
        Code 1 when the file is invalid or unreadable (every problem is printed first).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from click.testing import CliRunner
    >>> from protocols.examples import example_dataset
    >>> from protocols.io import save_traces
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = save_traces(example_dataset(), pathlib.Path(tmp) / "t.nc")
    ...     print(CliRunner().invoke(validate, [str(path)]).output.strip())
    ok: coupled, 2 docs × 2 policies × 4 replicates × T=8 (t.nc)
    """
    try:
        with dask_client(workers, scheduler):  # no cluster unless asked; large files are read chunk by chunk
            ds = _load(path, read_chunks(path, workers, scheduler, chunk_docs))
            _validate(ds, source=f"({path.name})")
    except TraceValidationError as err:
        click.echo(f"invalid: {len(err.problems)} problem(s) in {path.name}")
        for p in err.problems:
            click.echo(f"  - {p}")
        raise SystemExit(1) from None
    except (StreamError, OSError, ValueError, ImportError) as err:
        click.echo(f"invalid: {path.name}: {err}")
        raise SystemExit(1) from None
    click.echo(f"ok: {ds.attrs['kind']}, {_shape(ds)} ({path.name})")


def _num(v: float | int, missing: object) -> str:
    if isinstance(v, float) and math.isnan(v) or v == missing:
        return "-"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _ids(values, limit: int = 6) -> str:
    ids = [str(v) for v in values]
    return ", ".join(ids[:limit]) + (f", … (+{len(ids) - limit})" if len(ids) > limit else "")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(exists=True, dir_okay=True, path_type=Path))
def info(path: Path) -> None:
    """Summarise the trace file PATH: kind, sizes, model, sampling, docs and policies.

    Works on invalid files too (the last line says whether the file is valid).
    \f
    Parameters
    ----------
    path : pathlib.Path
        The file to describe.

    Returns
    -------
    None
        Prints one ``key  value`` line per property.

    Raises
    ------
    SystemExit
        Code 1 when the file cannot be read at all.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from click.testing import CliRunner
    >>> from protocols.examples import example_dataset
    >>> from protocols.io import save_traces
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = save_traces(example_dataset(), pathlib.Path(tmp) / "t.nc")
    ...     print(CliRunner().invoke(info, [str(path)]).output.splitlines()[-1])
    valid       yes
    """
    try:
        ds = _load(path, read_chunks(path))   # a large file is read chunk by chunk, for the validity line
    except (StreamError, TraceValidationError, OSError, ValueError) as err:
        click.echo(f"error: cannot read {path.name}: {err}")
        raise SystemExit(1) from None
    if "schema" not in ds.attrs:  # another program's file: nothing of ours to summarise
        click.echo(f"error: {path.name} is not a kvdiv trace file (no 'schema' attribute; variables: "
                   f"{', '.join(map(str, ds.data_vars)) or 'none'})")
        raise SystemExit(1)
    a = ds.attrs
    tokens = a.get("kind") != Kind.ANSWERS   # an answers file has scores, no tokens
    rows = [
        ("file", str(path)),
        ("schema", str(a.get("schema", "?"))),
        ("kind", f"{a.get('kind', '?')} (coupling {a.get('coupling', '?')})" if tokens
                 else f"{a.get('kind')} (task scores without tokens)"),
    ]
    if tokens:
        rows += [
            ("horizon", f"T={a.get('horizon', '?')}, window W={a.get('window', '?')}"),
            ("vocab", f"{a.get('vocab_size', '?')} tokens, eos_token_id {a.get('eos_token_id', '?')}"
                      + (f" (eos_token_ids {list(eos_ids(a))})" if "eos_token_ids" in a else "")),
        ]
    rows += [
        ("model", str(a.get("model", "?")) + (f" ({ds.sizes['model']} models: {_ids(ds.model.values)})"
                                               if "model" in ds.dims else "")),
        ("sampling", str(a.get("sampling", "?"))),
        ("producer", str(a.get("producer", "?"))),
        ("replicates", str(ds.sizes.get("replicate", 0))),
        ("docs", _docs(ds)),
        ("policies", str(ds.sizes.get("policy", 0))),
    ]
    answers = _answers(ds)
    if answers:
        rows.insert(-1, ("answers", answers))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")
    for line in _policies(ds):
        click.echo(f"{'':<{width}}    {line}")
    click.echo(f"{'variables':<{width}}  {', '.join(ds.data_vars)}")
    try:
        _validate(ds)
        click.echo(f"{'valid':<{width}}  yes")
    except TraceValidationError as err:
        click.echo(f"{'valid':<{width}}  no: {len(err.problems)} problem(s); run `kvdiv validate {path}`")


def _answers(ds: xr.Dataset) -> str:
    """The task-answer summary: tasks, scorers and P's and Q's mean scores ('' without scores)."""
    if "x_score" not in ds.data_vars or "y_score" not in ds.data_vars:
        return ""
    parts = []
    for name in ("task", "scorer"):
        if name in ds.data_vars:
            parts.append(f"{name} {', '.join(sorted({str(v) for v in ds[name].values.ravel()}))}")
    x, y = (float(ds[n].mean(skipna=True)) if bool(ds[n].notnull().any()) else math.nan for n in ("x_score", "y_score"))
    parts.append(f"mean score P {_num(round(x, 3), None)}, Q {_num(round(y, 3), None)}")
    return "; ".join(parts)


def _docs(ds: xr.Dataset) -> str:
    if "doc" not in ds.coords:
        return "?"
    text = f"{ds.sizes['doc']}: {_ids(ds.doc.values)}"
    if "split" in ds.coords:
        splits = [str(s) for s in ds.split.values]
        counts = {name: splits.count(key) for name, key in
                  (("exploratory", "exploratory"), ("confirmatory", "confirmatory"), ("unsplit", ""))}
        text += " (" + ", ".join(f"{k} {v}" for k, v in counts.items() if v) + ")"
    return text


def _policies(ds: xr.Dataset) -> list[str]:
    if "policy" not in ds.coords:
        return []
    ids = [str(p) for p in ds.policy.values]
    w = max(len(p) for p in ids) if ids else 0
    out = []
    for i, pid in enumerate(ids):
        press = str(ds.press.values[i]) if "press" in ds.coords else "?"
        ret = _num(float(ds.retention.values[i]), None) if "retention" in ds.coords else "?"
        bud = _num(int(ds.budget.values[i]), -1) if "budget" in ds.coords else "?"
        out.append(f"{pid:<{w}}  press={press}  retention={ret}  budget={bud}")
    return out

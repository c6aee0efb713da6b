"""Bring a leaderboard's results: kvpress's evaluation output → answer rows → an ``answers`` dataset.

kvpress's ``evaluation/evaluate.py`` writes one folder per (dataset, model, press,
compression ratio, options) holding ``predictions.csv`` (the dataset's columns less
``context``, plus ``predicted_answer``), ``metrics.json`` and ``config.yaml``. Its rows
carry no id: every run of one dataset (same ``fraction`` and seed) holds the same rows
in the same order, so rows pair by position, and each pair is checked (every column
the two files share, except the prediction and the ratio, must be equal).

:func:`read_kvpress_results` gives the plain answer rows (one per document and press:
``doc``, ``policy``, ``prediction``, ``answers``, ``reference_prediction``, ``task``,
``scorer``); :func:`from_answer_rows` turns answer rows (these, or a JSONL file of
them) into an ``answers`` dataset, scoring each prediction and the reference's with
the row's scorer: P is the reference (no-press) run, Q the press, ``replicate`` = 1.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from protocols.errors import ConversionError, ProtocolError
from protocols.log_rows import log_rows

__all__ = ["KvpressFolder", "from_answer_rows", "from_kvpress_results", "parse_answer_cell", "read_kvpress_results"]

PREDICTIONS, METRICS, CONFIG = "predictions.csv", "metrics.json", "config.yaml"
#: Columns that differ between the runs of one dataset by design.
_PER_RUN = {"predicted_answer", "compression_ratio"}
#: The config keys that make two folders runs of the same rows (everything but the press).
_SETTING = ("dataset", "data_dir", "model", "fraction", "max_context_length", "query_aware", "needle_depth",
            "max_new_tokens", "seed")
_QUOTED = re.compile(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"", re.S)
_RATIO = re.compile(r"^\d+\.\d\d$")


def _error(message: str) -> ProtocolError:
    return ConversionError(message)


class KvpressFolder:
    """One kvpress result folder: its config (from config.yaml, else the folder's name) and rows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = _read_config(path)
        self.dataset = str(self.config.get("dataset") or "")
        self.press = str(self.config.get("press_name") or "")
        self.model = str(self.config.get("model") or "")
        pred = path / PREDICTIONS
        if not pred.is_file():
            raise _error(f"{path}: a kvpress result folder without {PREDICTIONS} (its run did not finish, or the "
                         "file was not copied)")
        self.rows, self.lines = _read_csv(pred)

    def where(self, i: int) -> str:
        """``predictions.csv: line N``: where row ``i`` starts (a quoted field may span lines)."""
        return f"{self.path / PREDICTIONS}: line {self.lines[i]}"

    @property
    def setting(self) -> tuple[str, ...]:
        """What must agree for two folders to hold the same rows."""
        return tuple(str(self.config.get(k)) for k in _SETTING)

    @property
    def label(self) -> str:
        """The dataset (and data_dir) as a doc-id prefix: ``ruler/4096``."""
        data_dir = self.config.get("data_dir")
        return self.dataset + (f"/{data_dir}" if data_dir not in (None, "", "null") else "")

    def policy_id(self) -> str:
        """A kvdiv policy id: ``press@retention`` (kvpress's ratio is the fraction removed);
        ``press:threshold=t`` or ``press:head_compression_ratio=r`` for presses set that way."""
        for key in ("threshold", "head_compression_ratio"):   # kvpress then names the folder by it
            if self.config.get(key) not in (None, "null"):
                return f"{self.press}:{key}={_num(self.config[key])}"
        ratio = self.config.get("compression_ratio")
        try:
            retention = round(1.0 - float(ratio), 6)
        except (TypeError, ValueError):
            return self.press
        pid = f"{self.press}@{retention:g}" if 0 < retention <= 1 else self.press
        extra = self.config.get("key_channel_compression_ratio")
        if extra not in (None, "null"):
            pid += f":key_channel_compression_ratio={_num(extra)}"
        if str(self.config.get("query_aware")).lower() == "true":
            pid += ("," if ":" in pid else ":") + "query_aware=true"
        return pid


def _num(value: Any) -> str:
    try:
        return f"{float(value):g}"
    except (TypeError, ValueError):
        return str(value)


def _read_config(path: Path) -> dict[str, Any]:
    """config.yaml's top-level scalars (kvpress writes it with yaml.dump: ``key: value`` lines), else the
    folder's name ``dataset[__data_dir]__model__press__ratio[__option...]``."""
    cfg_path = path / CONFIG
    if cfg_path.is_file():
        config: dict[str, Any] = {}
        for line in cfg_path.read_text(encoding="utf-8").splitlines():
            if line[:1] in (" ", "\t", "#", "-") or ":" not in line:
                continue   # nested (model_kwargs) and list items: not needed here
            key, _, value = line.partition(":")
            value = value.strip().strip("'\"")
            config[key.strip()] = None if value in ("null", "~", "") else value
        if "dataset" in config and "press_name" in config:
            return config
    parts = (path.parent.name if path.name.isdigit() else path.name).split("__")
    at = next((i for i, p in enumerate(parts) if _RATIO.match(p) and i >= 3), None)
    if at is None:
        raise _error(f"{path}: no {CONFIG} and the folder's name is not kvpress's "
                     "dataset[__data_dir]__model__press__ratio")
    return {"dataset": parts[0], "data_dir": parts[1] if at == 4 else None, "model": parts[at - 2].replace("--", "/"),
            "press_name": parts[at - 1], "compression_ratio": parts[at], "options": "__".join(parts[at + 1:])}


def _read_csv(path: Path) -> tuple[list[dict[str, str]], list[int]]:
    """The rows and the line each starts on."""
    csv.field_size_limit(2**31 - 1)   # a prediction may be long; the default is 128 KiB
    rows, lines = [], []
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            columns = reader.fieldnames or []
            start = reader.line_num + 1
            for row in reader:
                rows.append(row)
                lines.append(start)
                start = reader.line_num + 1
    except (UnicodeDecodeError, csv.Error) as exc:
        raise _error(f"{path}: not a CSV file ({exc})") from None
    if "predicted_answer" not in columns:
        raise _error(f"{path}: no 'predicted_answer' column (columns: {', '.join(columns) or 'none'})")
    return rows, lines


def parse_answer_cell(text: str) -> list[str]:
    """The reference answers of a predictions.csv cell.

    pandas writes a list column as the list's ``str``: numpy's ``['a' 'b']`` (no commas,
    perhaps wrapped over lines) for an array, Python's ``['a', 'b']`` for a list; a
    scalar (AIME's 42) as itself.

    Parameters
    ----------
    text : str
        The cell.

    Returns
    -------
    list of str

    Raises
    ------
    ValueError
        A bracketed cell whose strings cannot be read.

    Examples
    --------
    >>> parse_answer_cell("['8090' 'Paris']"), parse_answer_cell("['a', 'b']"), parse_answer_cell("42")
    (['8090', 'Paris'], ['a', 'b'], ['42'])
    """
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return [text]
    inner = stripped[1:-1].strip()
    if not inner:
        return []
    found = [m.group(0) for m in _QUOTED.finditer(inner)]
    if not found:   # numbers: [1 2] or [1, 2]
        return [t for t in re.split(r"[\s,]+", inner) if t]
    return [str(ast.literal_eval(q)) for q in found]


def _folders(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Result folders under the given paths (a folder itself, or any folder below holding kvpress files)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such folder")
        if not p.is_dir():
            raise _error(f"{p}: not a folder (kvpress writes one folder per run, holding {PREDICTIONS})")
        marked = [d for d in [p, *sorted(q for q in p.rglob("*") if q.is_dir())]
                  if any((d / name).is_file() for name in (PREDICTIONS, METRICS, CONFIG))]
        if not marked:
            raise _error(f"{p}: no kvpress result folder (none holds {PREDICTIONS}, {METRICS} or {CONFIG})")
        out += [d for d in marked if d not in out]
    return out


def _check_pairing(ref: KvpressFolder, run: KvpressFolder) -> None:
    if len(run.rows) != len(ref.rows):
        raise _error(f"{run.path / PREDICTIONS}: {len(run.rows)} rows, but the {ref.press} run "
                     f"{ref.path / PREDICTIONS} has {len(ref.rows)}; rows pair by position, so both runs must "
                     "cover the same rows (same dataset, fraction and seed)")
    shared = [c for c in ref.rows[0] if c in run.rows[0] and c not in _PER_RUN] if ref.rows else []
    for i, (a, b) in enumerate(zip(ref.rows, run.rows, strict=True)):
        for col in shared:
            if a[col] != b[col]:
                raise _error(f"{run.where(i)}: column {col!r} is {b[col][:60]!r}, but row {i + 1} of the "
                             f"{ref.press} run ({ref.where(i)}) has {a[col][:60]!r}; the runs' rows do not pair")


def _answers_of(folder: KvpressFolder, i: int, row: Mapping[str, str]) -> list[str]:
    order = ("needle", "answers", "answer") if folder.dataset == "needle_in_haystack" else ("answers", "answer")
    column = next((c for c in order if c in row), None)
    if column is None:
        raise _error(f"{folder.where(i)}: no 'answer' or 'answers' column")
    try:
        return parse_answer_cell(row[column])
    except (ValueError, SyntaxError):
        raise _error(f"{folder.where(i)}: field {column!r} = {row[column][:60]!r} is not a list of strings") from None


def read_kvpress_results(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *,
                         reference: str = "no_press") -> list[dict[str, Any]]:
    """The answer rows of kvpress result folders, paired with the reference run's.

    Parameters
    ----------
    paths : path or iterable of paths
        Result folders, or folders holding them (searched below).
    reference : str, default "no_press"
        The press whose run is P (kvpress's ``press_name``).

    Returns
    -------
    list of dict
        One row per (document, press other than the reference): ``doc``
        (``dataset[/data_dir]/task/N``, N the CSV row), ``policy``, ``prediction``,
        (``dataset[/data_dir]/N`` when the task is the dataset or data_dir),
        ``answers`` (list of str), ``reference_prediction``, ``task``, ``scorer``,
        ``model``, ``source`` (``file:line``) and ``needle_depth`` where the rows have it.

    Raises
    ------
    FileNotFoundError
        A path that does not exist.
    ConversionError
        A folder without predictions, a press without a reference run, rows that do
        not pair, two models, two runs of one press and ratio, or a task whose metric
        kvdiv does not compute; each names the file (and line).

    Examples
    --------
    >>> rows = read_kvpress_results("results/")                      # doctest: +SKIP
    >>> rows[0]["doc"], rows[0]["policy"], rows[0]["scorer"]          # doctest: +SKIP
    ('ruler/4096/niah_single_1/0', 'snapkv@0.5', 'ruler_all')
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    folders = [KvpressFolder(p) for p in _folders(paths)]
    models = {f.model for f in folders}
    if len(models) > 1:
        raise _error(f"runs of {len(models)} models ({', '.join(sorted(models))}); convert each model's folders "
                     "separately")
    groups: dict[tuple[str, ...], list[KvpressFolder]] = {}
    for f in folders:
        groups.setdefault(f.setting, []).append(f)
    rows = [row for group in groups.values() for row in _group_rows(group, reference)]
    if not rows:
        raise _error(f"only {reference!r} runs found; nothing to compare with")
    return rows


def _group_rows(group: list[KvpressFolder], reference: str) -> Iterable[dict[str, Any]]:
    """The answer rows of one dataset setting's runs, each press paired with the reference run."""
    from protocols.leaderboard_scoring import UnscorableError, kvpress_scorer

    refs = [f for f in group if f.press == reference]
    if not refs:
        raise _error(f"{group[0].path}: press {group[0].press!r} on {group[0].label} has no {reference!r} run "
                     f"with the same settings to pair with (runs found: {', '.join(str(f.path) for f in group)})")
    if len(refs) > 1:
        raise _error(f"two {reference!r} runs of {refs[0].label}: {refs[0].path} and {refs[1].path}; keep one")
    ref = refs[0]
    seen: dict[str, Path] = {}
    for run in (f for f in group if f is not ref):
        pid = run.policy_id()
        if pid in seen:
            raise _error(f"two runs of {pid} on {run.label}: {seen[pid]} and {run.path}; keep one")
        seen[pid] = run.path
        _check_pairing(ref, run)
        for i, (a, b) in enumerate(zip(ref.rows, run.rows, strict=True)):
            task = a.get("task") or run.dataset
            try:
                scorer = kvpress_scorer(run.dataset, task)
            except UnscorableError as exc:
                raise _error(f"{run.where(i)}: {exc}") from None
            own = task in (run.dataset, run.config.get("data_dir"))
            row = {"doc": f"{ref.label}/{i}" if own else f"{ref.label}/{task}/{i}", "policy": pid,
                   "prediction": b["predicted_answer"], "answers": _answers_of(run, i, b),
                   "reference_prediction": a["predicted_answer"], "task": task, "scorer": scorer,
                   "model": run.model, "source": f"{run.path / PREDICTIONS}:{run.lines[i]}"}
            if a.get("needle_depth") not in (None, ""):
                row["needle_depth"] = float(a["needle_depth"]) / 100   # kvpress: percent; kvdiv: a fraction
            yield row


def _answer_records(source: Any) -> Iterable[tuple[str, dict[str, Any]]]:
    for label, rec in log_rows(source):
        if isinstance(rec, (str, bytes)):
            try:
                rec = json.loads(rec)
            except ValueError as exc:
                raise ConversionError(f"{label}: not valid JSON ({exc})") from None
        if not isinstance(rec, Mapping):
            raise ConversionError(f"{label}: expected a JSON object, got {type(rec).__name__}")
        yield label, dict(rec)


def _field(label: str, rec: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in rec:
        raise _error(f"{label}: missing field {name!r}")
    value = rec[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _error(f"{label}: field {name!r} = {str(value)[:60]!r} is not a {want}")
    return value


def _answer_row(label: str, rec: Mapping[str, Any], scorer: str | None) -> tuple[str, str, str, dict[str, Any]]:
    """(doc, policy, prediction, the document's fields) of one answer row, each field checked."""
    from protocols.scoring import UnknownScorerError, get_scorer

    doc = str(_field(label, rec, "doc", (str, int)))
    policy = _field(label, rec, "policy", str)
    pred = _field(label, rec, "prediction", str)
    ref = _field(label, rec, "reference_prediction", str)
    answers = _field(label, rec, "answers", list)
    if not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in answers):
        raise _error(f"{label}: field 'answers' holds a non-string")
    name = rec.get("scorer", scorer)
    if not isinstance(name, str):
        raise _error(f"{label}: no field 'scorer' and no default scorer given (--scorer)")
    try:
        get_scorer(name)
    except UnknownScorerError as exc:
        raise _error(f"{label}: field 'scorer': {exc}") from None
    meta = {"reference_prediction": ref, "answers": [str(a) for a in answers], "scorer": name,
            "task": str(rec.get("task", "")), "needle_depth": rec.get("needle_depth", math.nan), "label": label}
    return doc, policy, pred, meta


def from_answer_rows(source: Any, *, scorer: str | None = None, model: str = "",
                     producer: str = "answer rows (protocols.kvpress_results.from_answer_rows)") -> xr.Dataset:
    """An ``answers`` dataset from answer rows: a JSONL file, or an iterable of dicts or JSON lines.

    A row holds ``doc``, ``policy``, ``prediction`` (Q's answer), ``reference_prediction``
    (P's answer to the same document), ``answers`` (a list of acceptable strings) and
    optionally ``scorer`` (else the ``scorer`` argument), ``task``, ``needle_depth``,
    ``model``. Both predictions are scored with the scorer; a document's P answer must
    be the same in every row of it (P is one run); a missing (doc, policy) is NaN.

    Parameters
    ----------
    source : path or iterable
        A JSONL file or rows.
    scorer : str, optional
        The scorer of rows without one (``protocols.scoring``).
    model, producer : str
        The dataset's attrs (``model`` defaults to the rows' own).

    Returns
    -------
    xarray.Dataset
        A validated ``answers`` dataset with one replicate.

    Raises
    ------
    FileNotFoundError
        A path that does not exist.
    ConversionError
        A row that is not JSON, lacks a field, has one of the wrong type, names an
        unknown scorer, repeats a (doc, policy), or gives a document two P answers;
        each names the line (or record).

    Examples
    --------
    >>> rows = [{"doc": "q1", "policy": "snapkv@0.5", "prediction": "It is 4711.",
    ...          "reference_prediction": "4711", "answers": ["4711"], "scorer": "ruler_all"},
    ...         {"doc": "q1", "policy": "recent@0.5", "prediction": "I forgot.",
    ...          "reference_prediction": "4711", "answers": ["4711"], "scorer": "ruler_all"}]
    >>> ds = from_answer_rows(rows)
    >>> ds.attrs["kind"], ds.x_score.values.ravel().tolist(), ds.y_score.values.ravel().tolist()
    ('answers', [1.0, 1.0], [1.0, 0.0])
    """
    from protocols.scoring import score as score_one

    cells: dict[tuple[str, str], tuple[float, str]] = {}
    per_doc: dict[str, dict[str, Any]] = {}
    policies: list[str] = []
    models: set[str] = set()
    for label, rec in _answer_records(source):
        doc, policy, pred, meta = _answer_row(label, rec, scorer)
        if (doc, policy) in cells:
            raise _error(f"{label}: doc {doc!r}, policy {policy!r} already given")
        name, answers = meta["scorer"], meta["answers"]
        first = per_doc.setdefault(doc, meta)
        for key in ("reference_prediction", "answers", "scorer"):
            if first[key] != meta[key]:
                raise _error(f"{label}: doc {doc!r} has field {key!r} = {str(meta[key])[:60]!r}, but "
                             f"{first['label']} gave {str(first[key])[:60]!r} (P answers each document once)")
        cells[(doc, policy)] = (score_one(name, pred, answers), pred)
        if policy not in policies:
            policies.append(policy)
        if isinstance(rec.get("model"), str):
            models.add(rec["model"])
    if not cells:
        raise _error("no answer rows")
    docs = list(per_doc)
    shape = (len(docs), len(policies), 1)
    xs, ys = np.full(shape, np.nan), np.full(shape, np.nan)
    xt = np.full(shape, "", dtype=object)
    yt = np.full(shape, "", dtype=object)
    for d, doc in enumerate(docs):
        m = per_doc[doc]
        xs[d, :, 0] = score_one(m["scorer"], m["reference_prediction"], m["answers"])
        xt[d, :, 0] = m["reference_prediction"]
        for p, policy in enumerate(policies):
            if (doc, policy) in cells:
                ys[d, p, 0], yt[d, p, 0] = cells[(doc, policy)]
    return _answers(xs, ys, xt, yt, docs, policies, per_doc, model or ", ".join(sorted(models)), producer)


def _answers(xs: np.ndarray, ys: np.ndarray, xt: np.ndarray, yt: np.ndarray, docs: Sequence[str],
             policies: Sequence[str], per_doc: Mapping[str, Mapping[str, Any]], model: str,
             producer: str) -> xr.Dataset:
    from protocols.schema import answers_dataset
    from protocols.validate import validate

    extra: dict[str, Any] = {
        "answers": [per_doc[d]["answers"] for d in docs], "scorer": [per_doc[d]["scorer"] for d in docs],
        "task": [per_doc[d]["task"] for d in docs]}
    depth = [float(per_doc[d]["needle_depth"]) for d in docs]
    if not all(math.isnan(v) for v in depth):
        extra["needle_depth"] = depth
    ds = answers_dataset(xs, ys, docs=list(docs), policies=list(policies), model=model, producer=producer,
                         x_text=xt, y_text=yt, **extra)
    return validate(ds, source="(answer rows)")


def from_kvpress_results(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *,
                         reference: str = "no_press") -> xr.Dataset:
    """An ``answers`` dataset from kvpress's evaluation output (issue "Bring a leaderboard's results").

    Reads every result folder under ``paths`` (:func:`read_kvpress_results`), pairs
    each press's rows with the ``reference`` run's, and scores both predictions with
    the scorer kvpress uses for the dataset and task
    (:func:`protocols.leaderboard_scoring.kvpress_scorer`): ``x_score`` is the
    reference's (P), ``y_score`` the press's (Q), one replicate. Each policy's mean
    ``y_score`` over a task, times 100, is kvpress's ``metrics.json`` number for it.

    Parameters
    ----------
    paths : path or iterable of paths
        Result folders, or folders holding them.
    reference : str, default "no_press"
        The press whose run is P.

    Returns
    -------
    xarray.Dataset
        A validated ``answers`` dataset; docs ``dataset[/data_dir]/task/N``, policies
        ``press@retention`` (retention = 1 − kvpress's compression ratio).

    Raises
    ------
    FileNotFoundError, ConversionError
        As :func:`read_kvpress_results`.

    Examples
    --------
    >>> ds = from_kvpress_results("results/")                        # doctest: +SKIP
    >>> ds.y_score.sel(policy="snapkv@0.5").mean().item()            # doctest: +SKIP
    0.58
    """
    rows = read_kvpress_results(paths, reference=reference)
    model = rows[0]["model"]
    return from_answer_rows(rows, model=model,
                            producer=f"kvpress evaluation results (protocols.converters.from_kvpress_results, "
                                     f"reference {reference!r})")

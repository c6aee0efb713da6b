"""``kvdiv convert``: traces from elsewhere into one validated trace file.

Four inputs, told apart by their form (or named with ``--from``):

* ``eval-log``: JSONL rows with ``tokens``, ``logp_full``, ``logp_evicted``
  (:func:`protocols.converters.from_eval_logs`) → a ``reference`` dataset;
* ``openai``: a JSON file ``{"samples": {doc: [response, ...]}, "scores": {policy:
  {doc: [...]}}, "vocab_size": V, "token_ids": {...}, "eos_token_ids": [...]}``
  (:func:`protocols.converters.from_openai_logprobs`) → a ``reference`` dataset;
* ``answers``: JSONL answer rows with ``doc``, ``policy``, ``prediction``,
  ``reference_prediction``, ``answers`` (:func:`protocols.converters.from_answer_rows`)
  → an ``answers`` dataset;
* ``kvpress``: kvpress evaluation result folders
  (:func:`protocols.converters.from_kvpress_results`) → an ``answers`` dataset.

Every conversion error is one line naming the input file, the line (or record or
field) and the problem, with exit status 1 and no traceback. Imports only protocols,
numpy, xarray and click.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import xarray as xr

from protocols.errors import ProtocolError
from protocols.io import SUFFIXES, save_traces
from protocols.validate import TraceValidationError

__all__ = ["KINDS", "convert", "convert_inputs", "sniff"]

#: The input kinds ``--from`` names.
KINDS = ("eval-log", "openai", "answers", "kvpress")


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    raise SystemExit(1)


def sniff(path: Path) -> str:
    """The input kind of ``path``: a folder is kvpress results, a ``.json`` file OpenAI-format responses, a
    JSONL file an evaluation log or answer rows by its first row's fields.

    Parameters
    ----------
    path : pathlib.Path
        An input.

    Returns
    -------
    str
        One of :data:`KINDS`.

    Raises
    ------
    ValueError
        The form says none of them (the message names the file and line).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.jsonl"
    >>> _ = p.write_text('{"doc": "q", "policy": "snapkv@0.5", "prediction": "1", '
    ...                  '"reference_prediction": "1", "answers": ["1"], "scorer": "exact"}\\n')
    >>> sniff(p)
    'answers'
    """
    if path.is_dir():
        return "kvpress"
    if path.suffix.lower() == ".json":
        return "openai"
    with path.open("rb") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                first = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}: line {n}: not valid JSON ({exc})") from None
            if isinstance(first, Mapping) and "tokens" in first:
                return "eval-log"
            if isinstance(first, Mapping) and "prediction" in first:
                return "answers"
            raise ValueError(f"{path}: line {n}: neither an evaluation-log row (tokens, logp_full, logp_evicted) nor "
                             "an answer row (doc, policy, prediction, reference_prediction, answers); name the "
                             f"input's kind with --from ({', '.join(KINDS)})")
    raise ValueError(f"{path}: empty file")


def _openai(path: Path, opts: Mapping[str, Any]) -> xr.Dataset:
    from protocols.converters import ConversionError, from_openai_logprobs

    try:
        bundle = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConversionError(f"not valid JSON ({exc})") from None
    if not isinstance(bundle, Mapping) or "samples" not in bundle or "scores" not in bundle:
        raise ConversionError("expected a JSON object with 'samples' (doc -> the full model's responses) and "
                              "'scores' (policy -> doc -> the compressed model's log-probabilities)")
    vocab = opts["vocab_size"] or bundle.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        raise ConversionError("field 'vocab_size' is missing or not an integer (or pass --vocab-size)")
    eos = list(opts["eos_token_id"]) or bundle.get("eos_token_ids") or (
        [bundle["eos_token_id"]] if isinstance(bundle.get("eos_token_id"), int) else None)
    return from_openai_logprobs(bundle["samples"], bundle["scores"], vocab_size=vocab,
                                token_ids=bundle.get("token_ids"), eos_token_ids=eos, horizon=opts["horizon"],
                                model=opts["model"] or str(bundle.get("model", "")))


def convert_inputs(inputs: list[Path], kind: str, **opts: Any) -> xr.Dataset:
    """The validated dataset of ``inputs`` of one kind (what ``kvdiv convert`` writes).

    Parameters
    ----------
    inputs : list of pathlib.Path
        One file (eval-log, openai, answers) or one or more folders (kvpress).
    kind : str
        One of :data:`KINDS`.
    **opts
        ``vocab_size``, ``eos_token_id`` (a tuple), ``horizon``, ``policy``,
        ``model``, ``reference``, ``scorer``, ``jsonl`` (kvpress: also write the
        answer rows there).

    Returns
    -------
    xarray.Dataset
        A validated dataset.

    Raises
    ------
    ConversionError, TraceValidationError, OSError
        What the converter raises; :func:`convert` words them as one line.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "e.jsonl"
    >>> _ = p.write_text('{"doc": "d", "tokens": [3, 1], "logp_full": [-0.1, -0.2], "logp_evicted": [-0.3, -0.4]}\\n')
    >>> convert_inputs([p], "eval-log", vocab_size=4, policy="snapkv@0.5").attrs["kind"]
    'reference'
    """
    from protocols.converters import ConversionError, from_answer_rows, from_eval_logs
    from protocols.kvpress_results import read_kvpress_results

    opts = {"vocab_size": None, "eos_token_id": (), "horizon": None, "policy": "candidate", "model": "",
            "reference": "no_press", "scorer": None, "jsonl": None, **opts}
    if kind != "kvpress" and len(inputs) != 1:
        raise ConversionError(f"{kind} input is one file, got {len(inputs)}")
    if kind == "eval-log":
        if opts["vocab_size"] is None:
            raise ConversionError("an evaluation log needs --vocab-size (token ids are checked against it)")
        eos = list(opts["eos_token_id"]) or None
        return from_eval_logs(inputs[0], vocab_size=opts["vocab_size"], eos_token_ids=eos, horizon=opts["horizon"],
                              policy=opts["policy"], model=opts["model"])
    if kind == "openai":
        return _openai(inputs[0], opts)
    if kind == "answers":
        return from_answer_rows(inputs[0], scorer=opts["scorer"], model=opts["model"])
    rows = read_kvpress_results(inputs, reference=opts["reference"])
    if opts["jsonl"] is not None:
        with Path(opts["jsonl"]).open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return from_answer_rows(rows, model=opts["model"] or rows[0]["model"],
                            producer=f"kvpress evaluation results (kvdiv convert, reference {opts['reference']!r})")


@click.command("convert", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="The trace file: .nc or .zarr.")
@click.option("--from", "kind", type=click.Choice(KINDS), default=None,
              help="The input's kind; default: a folder is kvpress results, .json OpenAI-format responses, .jsonl "
                   "an evaluation log or answer rows by its fields.")
@click.option("--vocab-size", type=click.IntRange(min=1), default=None, help="Vocabulary size (eval-log, openai).")
@click.option("--eos-token-id", type=click.IntRange(min=0), multiple=True, help="EOS id (repeatable).")
@click.option("--horizon", "-T", type=click.IntRange(min=1), default=None, help="Cut or pad rows to T steps.")
@click.option("--policy", default="candidate", show_default=True, help="Policy of eval-log rows without one.")
@click.option("--model", default="", help="The model's name (attr).")
@click.option("--reference", default="no_press", show_default=True, help="kvpress: the press whose run is P.")
@click.option("--scorer", default=None, help="answers: the scorer of rows without one (protocols.scoring).")
@click.option("--jsonl", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="kvpress: also write the plain answer rows (doc, policy, prediction, answers, "
                   "reference_prediction, ...) as JSONL.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out that kvdiv wrote.")
def convert(inputs: tuple[Path, ...], out: Path, kind: str | None, overwrite: bool, **opts: Any) -> None:
    """Convert INPUTS (an evaluation log, OpenAI-format responses, answer rows or kvpress result folders) into
    one validated trace file for `kvdiv analyze`.
    \f
    Parameters
    ----------
    inputs : tuple of pathlib.Path
        The input file, or kvpress result folders.
    out : pathlib.Path
        The trace file.
    kind : str, optional
        The inputs' kind (:data:`KINDS`); sniffed when None.
    overwrite : bool
        Replace an existing output kvdiv wrote.
    **opts
        As :func:`convert_inputs`.

    Returns
    -------
    None
        Prints ``ok: wrote OUT: kind, sizes (from KIND)``.

    Raises
    ------
    SystemExit
        Code 1 with one line naming the file, line and field.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from click.testing import CliRunner
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (tmp / "e.jsonl").write_text('{"doc": "d", "tokens": [3, "x"], "logp_full": [-0.1, -0.2], '
    ...                                  '"logp_evicted": [-0.3, -0.4]}\\n')
    >>> res = CliRunner().invoke(convert, [str(tmp / "e.jsonl"), "-o", str(tmp / "t.nc"), "--vocab-size", "4"])
    >>> res.exit_code, res.output.startswith("error: ")
    (1, True)
    """
    from protocols.cli import _shape

    label = ", ".join(map(str, inputs))
    if out.suffix.lower() not in SUFFIXES:
        _fail(f"{out}: the output must end in {' or '.join(SUFFIXES)}")
    try:
        kind = kind or sniff(inputs[0])
        if kind != "kvpress" and any(p.is_dir() for p in inputs):
            raise ValueError(f"{next(p for p in inputs if p.is_dir())}: a folder, but --from {kind} reads a file")
        ds = convert_inputs(list(inputs), kind, **opts)
    except TraceValidationError as err:
        more = f" (and {len(err.problems) - 1} more)" if len(err.problems) > 1 else ""
        _fail(f"{label}: the converted traces break the contract: {err.problems[0]}{more}")
    except (ProtocolError, ValueError, OSError, KeyError, TypeError) as err:
        text = str(err) if not isinstance(err, KeyError) else f"missing field {err}"
        text = " ".join(text.split())   # one line, whatever the converter wrote
        _fail(text if kind == "kvpress" or text.startswith(str(inputs[0])) else f"{label}: {text}")
    try:
        save_traces(ds, out, overwrite=overwrite)
    except (ProtocolError, ValueError, OSError) as err:
        _fail(" ".join(str(err).split()))
    click.echo(f"ok: wrote {out}: {ds.attrs['kind']}, {_shape(ds)} (from {kind})")

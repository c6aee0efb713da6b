"""The reference kind on the wire (protocols/wire.py, stream.py, assemble.py) and its optional ``tv``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from protocols import (
    StreamError,
    StreamWriter,
    TraceValidationError,
    assemble,
    dataset_lines,
    encode_line,
    header_record,
    reference_dataset,
    reference_step_record,
    validate,
)

EOS = 2


def cell(tv: bool = True):
    """One (doc, policy) reference cell, R = 2, T = 3: replicate 1 ends on EOS at step 2."""
    ds = reference_dataset([[1, 3, 1], [0, EOS, EOS]], [[-0.5, -1.0, -0.2], [-0.1, -2.0, 0.0]],
                           [[-0.7, -np.inf, -0.3], [-0.1, -1.5, 0.0]], vocab_size=5, eos_token_id=EOS,
                           docs=["d"], policies=["snapkv@0.5"])
    if tv:
        ds = ds.assign(tv=(ds.x_token.dims, np.array([[[[0.2, 0.5, 0.1], [0.0, 0.3, 0.0]]]], dtype=np.float32)))
    return validate(ds)


def test_round_trip_keeps_every_value_and_minus_infinity() -> None:
    ds = cell()
    lines = dataset_lines(ds)
    assert [json.loads(line)["type"] for line in lines] == ["header", *["reference_step"] * 3, "end"]
    assert json.loads(lines[2])["x_logq"] == [None, -1.5]      # -inf is null on the wire
    back = assemble(lines)
    assert back.attrs["kind"] == "reference" and back.attrs["window"] == 0
    for name in ("x_token", "x_logp", "x_logq", "tv"):
        np.testing.assert_array_equal(back[name].values, ds[name].values)


def test_reader_checks_order_shapes_and_window() -> None:
    lines = dataset_lines(cell())
    with pytest.raises(StreamError, match="expected reference_step record for step 2"):
        assemble([lines[0], lines[1], lines[3], lines[2], lines[4]])
    rec = json.loads(lines[1])
    rec["x_logp"] = [-0.5]
    with pytest.raises(StreamError, match="'x_logp' must be a list of length 2"):
        assemble([lines[0], encode_line(rec), *lines[2:]])
    head = json.loads(lines[0])
    head["window"] = 3
    with pytest.raises(StreamError, match="window 3 for a reference stream"):
        assemble([encode_line(head), *lines[1:]])


def _stream(steps: list[dict]) -> list[bytes]:
    w = StreamWriter()
    head = header_record(kind="reference", horizon=len(steps), window=0, model="m", eos_token_id=EOS, sampling={},
                         candidate={"policy": "snapkv@0.5"}, seed=1, prompt_tokens=3, retained_tokens=2,
                         replicates=1, vocab_size=5, doc="d")
    return [w.line(head), *(w.line(s) for s in steps), w.end(len(steps), 1, 0.0)]


@pytest.mark.parametrize(("step", "message"), [
    (reference_step_record(1, [0.2], [1], [float("nan")], [-0.1]), "x_logp.*not finite"),
    (reference_step_record(1, [float("nan")], [1], [-0.2], [-0.1]), "tv.*missing"),
    (reference_step_record(1, [1.5], [1], [-0.2], [-0.1]), "tv.*outside"),
    (reference_step_record(1, [0.2], [7], [-0.2], [-0.1]), "x_token.*outside"),
])
def test_assembled_numbers_are_validated(step: dict, message: str) -> None:
    with pytest.raises(TraceValidationError, match=message):
        assemble(_stream([step]))


def test_tv_after_eos_must_be_zero() -> None:
    steps = [reference_step_record(1, [0.3], [EOS], [-1.0], [-1.2]),
             reference_step_record(2, [0.1], [EOS], [0.0], [0.0])]
    with pytest.raises(TraceValidationError, match="tv.*nonzero after EOS"):
        assemble(_stream(steps))

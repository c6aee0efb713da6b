"""protocols.assemble: wire stream -> dataset, and every way a stream can be bad."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import xarray as xr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols import (
    StreamError,
    StreamWriter,
    TraceValidationError,
    assemble,
    dataset_lines,
    encode_line,
    error_record,
    header_record,
    step_record,
)
from protocols.examples import example_dataset
from protocols.schema import REQUIRED_ATTRS

EXTRA = ["retained_tokens", "seed", "request_id", "elapsed_s", "stream_sha256", "header_extra"]


def cell(kind="coupled", **kw):
    kw = {"docs": 1, "policies": 1, "replicates": 5, "horizon": 9, "seed": 3, **kw}
    return example_dataset(kind, **kw)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["coupled", "residual"]), seed=st.integers(0, 10_000), R=st.integers(1, 6),
       T=st.integers(1, 12), W=st.integers(0, 12), eos=st.sampled_from([None, 0, 3]))
def test_wire_round_trip(kind, seed, R, T, W, eos):
    ds = example_dataset(kind, docs=1, policies=1, replicates=R, horizon=T, window=min(W, T), seed=seed,
                         eos_token_id=eos, disjoint=0.1)
    back = assemble(dataset_lines(ds, seed=seed, retained_tokens=17, request_id="req-1", elapsed_s=1.5))
    xr.testing.assert_identical(ds.drop_attrs(), back.drop_vars(EXTRA).drop_attrs())
    for name in REQUIRED_ATTRS:
        assert back.attrs[name] == ds.attrs[name], name
    assert back.seed.item() == seed and back.retained_tokens.item() == 17 and back.request_id.item() == "req-1"
    assert back.elapsed_s.item() == 1.5 and back.attrs["reference_policy"] == "full"





def test_line_forms_are_equivalent():
    lines = dataset_lines(cell())
    a = assemble(lines)
    xr.testing.assert_identical(a, assemble(b"".join(lines)))
    xr.testing.assert_identical(a, assemble(b"".join(lines).decode()))
    xr.testing.assert_identical(a, assemble([ln.decode().rstrip("\n") for ln in lines]))
    xr.testing.assert_identical(a, assemble(ln.rstrip(b"\n") for ln in lines))


def test_sse_framing_is_accepted():
    lines = dataset_lines(cell("residual", window=3))
    sse = b"".join(b"data: " + ln.rstrip(b"\n") + b"\n\n" for ln in lines)
    xr.testing.assert_identical(assemble(sse), assemble(lines))


def test_doc_id_precedence():
    lines = dataset_lines(cell(), doc=None, request_id="rq")
    assert assemble(lines).doc.item() == "doc000"
    assert assemble(lines, doc="mine").doc.item() == "mine"
    h = json.loads(lines[0])
    h["doc"] = None
    w = StreamWriter()
    relined = [w.line(h)] + [w.line(json.loads(ln)) for ln in lines[1:-1]]
    relined.append(w.end(9, 5, 0.0))
    assert assemble(relined).doc.item() == "rq"


def test_header_extras_become_attrs_and_coords():
    ds = cell()
    lines = dataset_lines(ds, seed=None)
    h = json.loads(lines[0])
    h.update(prompt_template="Summarise: {doc}", gpu="H200", coupling="stepwise-maximal",
             candidate={"policy": "snapkv#512", "press": "snapkv", "retention": None, "budget": 512,
                        "note": "prompt shorter than budget"})
    w = StreamWriter()
    relined = [w.line(h)] + [w.line(json.loads(ln)) for ln in lines[1:-1]] + [w.end(9, 5, 2.0)]
    back = assemble(relined)
    assert back.attrs["prompt_template"] == "Summarise: {doc}"
    assert json.loads(back.header_extra.item()) == {"gpu": "H200", "candidate": {"note": "prompt shorter than budget"}}
    assert back.header_extra.dims == ("doc", "policy")
    assert back.policy.item() == "snapkv#512" and back.budget.item() == 512 and np.isnan(back.retention.item())
    assert back.seed.item() == -1 and back.seed.dtype == np.int64
    assert back.stream_sha256.item() == w.hexdigest


def expect(lines, pattern, exc=StreamError):
    with pytest.raises(exc, match=pattern):
        assemble(lines)


def test_truncated_stream():
    lines = dataset_lines(cell())
    expect(lines[:-1], "truncated stream: no end record")
    expect(lines[:4], r"truncated stream.*after step 3 of 9")


def test_truncated_residual_stream():
    lines = dataset_lines(cell("residual", window=2))
    expect(lines[:-1], "truncated stream: no end record")


def test_altered_byte_breaks_digest():
    lines = dataset_lines(cell())
    line = lines[3].decode()
    m = re.search(r'"x_token":\[(\d)', line)
    digit = m.group(1)
    altered = line[:m.start(1)] + str((int(digit) + 1) % 5) + line[m.end(1):]
    expect(lines[:3] + [altered.encode()] + lines[4:], "sha256 mismatch")


def test_altered_byte_breaking_json():
    lines = dataset_lines(cell())
    expect(lines[:3] + [lines[3][:-5] + b"\n"] + lines[4:], "line 4: not a JSON record")


def test_reordered_steps():
    lines = dataset_lines(cell())
    expect(lines[:2] + [lines[3], lines[2]] + lines[4:], "expected step record for step 2")


def test_reordered_header():
    lines = dataset_lines(cell())
    expect([lines[1], lines[0]] + lines[2:], "expected a 'header' record first")


def test_branch_before_shared_steps():
    lines = dataset_lines(cell("residual", window=2))
    branch = next(i for i, ln in enumerate(lines) if b'"type":"branch"' in ln)
    expect(lines[:2] + [lines[branch]] + lines[2:branch] + lines[branch + 1:], "expected shared_step record")


def test_error_terminated_stream():
    lines = dataset_lines(cell())
    expect(lines[:5] + [encode_line(error_record("CUDA out of memory", "OutOfMemoryError"))],
           "error record: OutOfMemoryError: CUDA out of memory")


def test_record_after_end():
    lines = dataset_lines(cell())
    expect(lines + [lines[1]], "record after 'end'")


def test_end_counts_must_match():
    lines = dataset_lines(cell())
    end = json.loads(lines[-1])
    end["replicates"] = 4
    expect(lines[:-1] + [encode_line(end)], "do not match the header")


def test_wrong_array_length():
    w = StreamWriter()
    head = header_record(kind="coupled", horizon=2, window=2, model="m", eos_token_id=None, sampling={},
                         candidate={"policy": "snapkv@0.5"}, seed=1, prompt_tokens=3, retained_tokens=2,
                         replicates=3, vocab_size=5, doc="d")
    lines = [w.line(head), w.line(step_record(1, [0.1, 0.1], [1, 1], [1, 1]))]
    expect(lines, r"line 2 \(step 1\): 'tv' must be a list of length 3, got 2")


def test_duplicate_branch_replicate():
    lines = dataset_lines(cell("residual", window=2, seed=5))
    branch = next(i for i, ln in enumerate(lines) if b'"type":"branch"' in ln)
    expect(lines[:branch + 1] + [lines[branch]] + lines[branch + 1:], "out of range .* or repeated")


def test_other_coupling_refused():
    lines = dataset_lines(cell())
    h = json.loads(lines[0])
    h["coupling"] = "independent"
    expect([encode_line(h)] + lines[1:], "coupling 'independent'")


def test_unknown_kind_has_no_wire_format():
    w = StreamWriter()
    head = header_record(kind="independent", horizon=2, window=0, model="m", eos_token_id=None, sampling={},
                         candidate={"policy": "snapkv@0.5"}, seed=1, prompt_tokens=3, retained_tokens=2,
                         replicates=1, vocab_size=5, doc="d")
    expect([w.line(head)], "no wire format")


def test_empty_stream():
    expect([], "empty stream")


def test_valid_stream_with_invalid_numbers():
    w = StreamWriter()
    head = header_record(kind="coupled", horizon=1, window=1, model="m", eos_token_id=None, sampling={},
                         candidate={"policy": "snapkv@0.5"}, seed=1, prompt_tokens=3, retained_tokens=2,
                         replicates=1, vocab_size=5, doc="d")
    lines = [w.line(head), w.line(step_record(1, [1.5], [1], [2]))]
    lines.append(w.end(1, 1, 0.0))
    expect(lines, r"tv\[doc='d', policy='snapkv@0.5', replicate=0, step=1\] = 1.5", TraceValidationError)


def test_assemble_is_fast_for_64_replicates_512_steps():
    lines = dataset_lines(example_dataset(docs=1, policies=1, replicates=64, horizon=512))
    t0 = time.perf_counter()
    ds = assemble(lines)
    assert ds.sizes["replicate"] == 64 and ds.sizes["step"] == 512
    assert time.perf_counter() - t0 < 2.0     # ~0.03 s here; generous for a shared 2-core box


def test_reader_limits_refuse_hostile_lines_without_crashing():
    from protocols import StreamLimits, read_stream

    lines = dataset_lines(cell())
    hostile = {
        b"[" * 100_000 + b"]" * 100_000: "nesting 100000 deep",
        b'{"type":"step","step":' + b"9" * 5000 + b"}": "integer literal of 5000 digits",
        b'{"type":"step","tv":"\xff"}': "not UTF-8",
        b'{"type":"step","tv":[NaN]}': "NaN is not JSON",
        b'{"type":"step","pad":"' + b"x" * 300_000 + b'"}': "300024 bytes",
    }
    for line, message in hostile.items():
        with pytest.raises(StreamError, match=message) as err:
            read_stream([lines[0], line, *lines[1:]], StreamLimits(line_bytes=250_000))
        assert err.value.reason == "malformed"
    # Within the limits, the same records read as usual.
    assert len(read_stream(lines, StreamLimits(line_bytes=250_000)).records) == 9


def test_reader_says_why_a_stream_is_refused():
    from protocols import StreamReader, read_stream

    lines = dataset_lines(cell())
    cases = {"truncated": lines[:-1], "altered": lines[:-1] + [lines[-1].replace(b'"sha256":"', b'"sha256":"0')],
             "failed": lines[:3] + [encode_line(error_record("boom", "validation"))]}
    for reason, stream in cases.items():
        with pytest.raises(StreamError) as err:
            read_stream(stream)
        assert err.value.reason == reason, (reason, err.value)
    assert err.value.record == {"type": "error", "error": "boom", "error_type": "validation"}
    # Incremental: a bad record is refused as soon as it arrives, not at the end.
    reader = StreamReader()
    reader.feed(lines[0])
    with pytest.raises(StreamError, match="expected step record for step 1"):
        reader.feed(lines[2])


def test_prompt_sha256_is_checked_and_kept():
    from protocols import prompt_digest

    lines = dataset_lines(cell())
    h = json.loads(lines[0])
    for value, ok in ((prompt_digest([1, 2, 3]), True), ("abc", False)):
        h["prompt_sha256"] = value
        w = StreamWriter()
        relined = [w.line(h)] + [w.line(json.loads(ln)) for ln in lines[1:-1]] + [w.end(9, 5, 0.0)]
        if ok:
            assert json.loads(assemble(relined).header_extra.item())["prompt_sha256"] == value
        else:
            expect(relined, "prompt_sha256 'abc' is not 64 lowercase hex digits")


def test_header_values_beyond_the_dataset_dtypes_are_stream_errors():
    lines = dataset_lines(cell())
    for key, value, message in (("budget", 2**40, "candidate.budget"), ("retention", "half", "retention")):
        h = json.loads(lines[0])
        h["candidate"] = {**h["candidate"], key: value}
        w = StreamWriter()
        relined = [w.line(h)] + [w.line(json.loads(ln)) for ln in lines[1:-1]] + [w.end(9, 5, 0.0)]
        expect(relined, message)

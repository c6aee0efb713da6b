"""Validation of ``kvdiv.trace/1`` datasets (docs/contract.md §1).

:func:`validate` checks a dataset against the contract and raises one
:class:`TraceValidationError` that lists *every* problem found, each naming the
variable or attribute, how many values break the rule and one example index
written with coordinate labels, e.g.::

    tv: 3 values outside [0, 1], e.g. tv[doc='d0', policy='snapkv@0.5', replicate=3, step=7] = 1.3

Every rule is vectorised over (doc, policy, replicate, step|age); the only Python
loops are over variables, rules and document chunks. The value rules are a table
(:data:`_VALUE_RULES`) run on one chunk of documents at a time: a dataset in memory
is one chunk, a dask-backed one (``open_traces(path, chunks=...)``) is checked
chunk by chunk in bounded memory (as dask tasks, so on a cluster when one is
active) and the per-chunk findings are merged: counts add up and the example is
the first offending value of the whole dataset, exactly as for one chunk. An optional leading ``model`` dim (datasets
combined across models) is allowed on every data variable; per-model
``vocab_size`` / ``eos_token_id`` (or ``eos_token_ids`` on (model, eos)) coordinates
on that dim, when present, take precedence over the global attributes.

EOS is a set (attr ``eos_token_ids`` when a model has several, else ``eos_token_id``):
any of its ids ends a side, and an ended side keeps emitting the id it ended on.

Float tolerance: where the two tokens of a coupled step differ the TV there must
exceed :data:`TV_ZERO_ATOL` (1e-7, about one float32 ulp at 1). The coupling
diverges with probability TV, so a mismatch at a TV indistinguishable from 0 marks
a producer bug; the expected number of false alarms on honest data is at most 1e-7
per step with TV <= 1e-7. The residual branch point t* (branch age 0) is drawn
*given* divergence, so there any TV > 0 is legitimate. The survival path may stop
at a TV within :data:`STOP_TV_ATOL` of 1. Other TV rules (range, "TV is 0 once
both sides emitted EOS") are exact.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xarray as xr

from protocols.chunks import DocChunk, doc_chunks, is_lazy
from protocols.errors import ProtocolError
from protocols.kinds import TRACE_KINDS, Kind
from protocols.logit_fields import LOGIT_FIELDS, LOGIT_TOKENS, LOGIT_TOP, logit_prefixes, logit_var_dims
from protocols.schema import (
    ANSWER_STR_VARS,
    ANSWER_VARS,
    COUPLING,
    KINDS,
    MISSING_TOKEN,
    OPTIONAL_VARS,
    PER_MODEL_COORDS,
    PROB_DTYPE,
    REQUIRED_ATTRS,
    REQUIRED_ATTRS_BY_KIND,
    REQUIRED_VARS,
    SCHEMA,
    SCORE_DTYPE,
    SPLITS,
    TOKEN_DTYPE,
    eos_table,
)

__all__ = [
    "BRANCH_TV_RTOL", "KL_ATOL", "LOGP_ATOL", "LSE_ATOL", "STOP_TV_ATOL", "TV_ZERO_ATOL", "Problem",
    "TraceValidationError", "validate",
]

#: A mismatch (tokens differ) needs TV above this; see the module docstring.
TV_ZERO_ATOL = 1e-7
#: A survival path may stop at a TV this close to 1 (float32 rounding of ½‖p − q‖₁).
STOP_TV_ATOL = 1e-5
#: log-probabilities may exceed 0 by this much (rounding of log 1).
LOGP_ATOL = 1e-5
#: branch_tv at age 0 and shared_tv at t* are the same TV; allowed difference.
BRANCH_TV_RTOL = 1e-5
#: KL and entropy may fall below 0 by this much (float32 sums over the vocabulary).
KL_ATOL = 1e-4
#: log Σ exp of a top-k's log-probabilities may exceed 0 by this much (float32 rounding).
LSE_ATOL = 1e-4

# Token-valued and TV-valued variables, whatever the kind.
_TOKEN_VARS = {"x_token", "y_token", "shared_token", "branch_x_token", "branch_y_token", "branch_step"}
_TV_VARS = {"tv", "shared_tv", "branch_tv"}
# The logit traces' token ids (protocols.logit_fields), on every path prefix.
_LOGIT_TOKEN_VARS = {prefix + name for prefix in ("", "shared_", "branch_") for name in LOGIT_TOKENS}


class Problem(str):
    """One problem message; ``.where`` maps dims to the example's coordinate labels ({} for attrs)."""

    where: dict[str, Any]

    def __new__(cls, text: str, where: dict[str, Any] | None = None) -> Problem:
        self = super().__new__(cls, text)
        self.where = dict(where or {})
        return self


class TraceValidationError(ProtocolError, ValueError):
    """A dataset that breaks the trace contract; ``.problems`` lists every problem."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = f"{len(self.problems)} problem(s) in trace dataset" + (f" {source}" if source else "")
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in self.problems))

    def __reduce__(self):  # picklable across processes despite the custom signature
        return (type(self), ([str(p) for p in self.problems], self.source))


@dataclass
class _Ctx:
    """What the value rules need: the kind, sizes and canonical numpy arrays of one document chunk."""

    kind: str
    horizon: int | None
    window: int | None
    vocab: Any                    # int or array broadcastable to the data (per model)
    eos: Any                      # EOS ids on the last axis, -1 padded: (k,) or (n_model, k)
    lead: tuple[str, ...]         # ("model",) or ()
    tv_atol: float = TV_ZERO_ATOL
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    dims: dict[str, tuple[str, ...]] = field(default_factory=dict)
    offset: int = 0               # index of the chunk's first document in the whole dataset


@dataclass(frozen=True)
class _Finding:
    """One rule applied to one variable of one chunk: how many values break it and the first one."""

    name: str
    what: str
    count: int
    index: tuple[int, ...] | None  # first offending element, indices into the whole dataset
    value: str | None


# ----------------------------------------------------------------------------- helpers

def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _label(ds: xr.Dataset, dim: str, i: int) -> str:
    if dim in ds.coords and ds.coords[dim].ndim == 1 and ds.coords[dim].dims == (dim,):
        v = ds.coords[dim].values[i]
        return repr(str(v)) if isinstance(v, (str, np.str_, bytes)) or ds.coords[dim].dtype == object else str(v)
    return str(i)


def _where(ds: xr.Dataset, dims: tuple[str, ...], idx: tuple[int, ...]) -> str:
    return ", ".join(f"{d}={_label(ds, d, int(i))}" for d, i in zip(dims, idx, strict=True))


def _fmt(v: Any) -> str:
    if isinstance(v, str):   # an answer text or label: quoted, and short
        return repr(v if len(v) <= 60 else v[:57] + "...")
    if isinstance(v, (float, np.floating)):
        # shortest repr of the stored precision: float32 1.3 prints as 1.3, not 1.29999995
        return "NaN" if np.isnan(v) else np.format_float_positional(v, trim="-")
    return str(v)


def _report(ctx: _Ctx, name: str, bad: np.ndarray, what: str) -> Iterator[_Finding]:
    """The count of True in ``bad`` and its first example (always one finding, so chunks line up)."""
    if not bad.any():
        yield _Finding(name, what, 0, None, None)
        return
    dims = ctx.dims[name]
    bad = np.broadcast_to(bad, ctx.arrays[name].shape)
    flat = int(np.argmax(bad))          # first offending element in C order
    idx = tuple(int(i) for i in np.unravel_index(flat, bad.shape))
    value = _fmt(ctx.arrays[name][idx])
    glob = tuple(i + ctx.offset if d == "doc" else i for d, i in zip(dims, idx, strict=True))
    yield _Finding(name, what, int(np.count_nonzero(bad)), glob, value)


def _problem(ds: xr.Dataset, dims: tuple[str, ...], f: _Finding) -> Problem:
    """The message for a finding, located with the whole dataset's coordinate labels."""
    idx = f.index or ()
    where = {d: _scalar(ds.coords[d].values[i]) if d in ds.coords else int(i) for d, i in zip(dims, idx, strict=True)}
    return Problem(f"{f.name}: {f.count} value(s) {f.what}, e.g. {f.name}[{_where(ds, dims, idx)}] = {f.value}",
                   where)


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def _after(mask: np.ndarray) -> np.ndarray:
    """True at positions strictly after the first True along the last axis."""
    seen = np.logical_or.accumulate(mask, axis=-1)
    out = np.zeros_like(seen)
    out[..., 1:] = seen[..., :-1]
    return out


def _lead(value: Any, ndim: int) -> np.ndarray:
    """A scalar, or a per-model vector shaped to broadcast against an ``ndim`` array led by ``model``."""
    v = np.asarray(value)
    return v.reshape((-1,) + (1,) * (ndim - 1)) if v.ndim == 1 else v


def _eos_mask(ctx: _Ctx, tokens: np.ndarray) -> np.ndarray:
    """Tokens that are one of the (per-model) EOS ids."""
    eos = np.asarray(ctx.eos)
    if eos.ndim == 2:  # (n_model, k): lead the data, the set on a trailing axis
        eos = eos.reshape((eos.shape[0],) + (1,) * (tokens.ndim - 1) + (eos.shape[1],))
    return ((tokens[..., None] == eos) & (eos >= 0)).any(axis=-1)


# ----------------------------------------------------------------------------- attrs and layout

def _check_attrs(ds: xr.Dataset) -> Iterator[str]:
    a = ds.attrs
    for name in REQUIRED_ATTRS_BY_KIND.get(a.get("kind"), REQUIRED_ATTRS):
        if name not in a:
            yield f"attribute {name!r} is missing"
    for name, expected in (("schema", SCHEMA), ("coupling", COUPLING)):
        if name in a and a[name] != expected:
            yield f"attribute {name!r} = {a[name]!r}, expected {expected!r}"
    if "kind" in a and a["kind"] not in KINDS:
        yield f"attribute 'kind' = {a['kind']!r} is not one of {KINDS}"
    yield from _check_attr_types(a)
    v, e = a.get("vocab_size"), a.get("eos_token_id")
    if _is_int(v) and _is_int(e) and e >= v:
        yield f"attribute 'eos_token_id' = {e} is outside [0, vocab_size={v}) (use -1 for none)"
    yield from _check_eos_ids(a)
    yield from _check_window(a)


def _check_eos_ids(a: dict[str, Any]) -> Iterator[str]:
    """``eos_token_ids`` (optional): distinct ids in the vocabulary, holding ``eos_token_id``."""
    if "eos_token_ids" not in a:
        return
    ids = np.atleast_1d(np.asarray(a["eos_token_ids"]))  # netCDF reads a 1-list back as a scalar
    if ids.ndim != 1 or not ids.size or not np.issubdtype(ids.dtype, np.integer):
        yield f"attribute 'eos_token_ids' = {a['eos_token_ids']!r} is not a non-empty list of integers"
        return
    v, e = a.get("vocab_size"), a.get("eos_token_id")
    bad = [int(i) for i in ids if i < 0 or (_is_int(v) and i >= v)]
    if bad:
        yield f"attribute 'eos_token_ids': {bad} outside [0, vocab_size={v})"
    if len(set(ids.tolist())) != ids.size:
        yield f"attribute 'eos_token_ids' = {ids.tolist()} repeats an id"
    if _is_int(e) and int(e) not in ids.tolist():
        yield f"attribute 'eos_token_id' = {e} is not one of eos_token_ids {ids.tolist()}"


def _check_attr_types(a: dict[str, Any]) -> Iterator[str]:
    for name, low in (("horizon", 1), ("vocab_size", 2), ("window", 0), ("eos_token_id", -1)):
        if name in a and not (_is_int(a[name]) and a[name] >= low):
            yield f"attribute {name!r} = {a[name]!r} is not an integer >= {low}"
    for name in ("model", "sampling", "producer"):
        if name in a and not isinstance(a[name], str):
            yield f"attribute {name!r} = {a[name]!r} is not a string"
    if isinstance(a.get("sampling"), str):
        try:
            if not isinstance(json.loads(a["sampling"]), dict):
                raise ValueError
        except ValueError:
            yield f"attribute 'sampling' = {a['sampling']!r} is not a JSON object"


def _check_window(a: dict[str, Any]) -> Iterator[str]:
    kind, h, w = a.get("kind"), a.get("horizon"), a.get("window")
    if not (_is_int(h) and _is_int(w)):
        return
    if kind == Kind.COUPLED and w != h:
        yield f"attribute 'window' = {w}: coupled traces are complete, so window must equal horizon = {h}"
    elif kind == Kind.REFERENCE and w != 0:
        yield f"attribute 'window' = {w}: reference traces observe nothing after divergence, so window must be 0"
    elif kind == Kind.RESIDUAL and w > h:
        yield f"attribute 'window' = {w} exceeds horizon = {h}"


def _check_ids(ds: xr.Dataset) -> Iterator[str]:
    """``doc`` and ``policy`` ids are present, strings and unique."""
    for dim in ("doc", "policy"):
        if dim not in ds.coords:
            yield f"coordinate {dim!r} is missing"
            continue
        ids = ds.variables[dim].values
        if not all(isinstance(i, (str, np.str_)) for i in ids):
            yield f"coordinate {dim!r}: ids must be strings"
        uniq, counts = np.unique(ids.astype(str), return_counts=True)
        if (counts > 1).any():
            yield f"coordinate {dim!r}: duplicate ids {sorted(uniq[counts > 1].tolist())}"


def _check_coords(ds: xr.Dataset, ctx: _Ctx) -> Iterator[str]:
    # ds.variables[name] where a coordinate is read: the Variable, without building a DataArray
    yield from _check_ids(ds)
    for name, dim in (("split", "doc"), ("prompt_tokens", "doc"), ("press", "policy"),
                      ("retention", "policy"), ("budget", "policy")):
        if name not in ds.coords:
            yield f"coordinate {name!r} (per {dim}) is missing"
        elif ds.variables[name].dims != (dim,) and not (
                name in PER_MODEL_COORDS and "model" in ds.dims and ds.variables[name].dims == ("model", dim)):
            yield f"coordinate {name!r} has dims {ds.variables[name].dims}, expected ({dim!r},)"
    if "split" in ds.coords:
        bad = sorted({str(s) for s in ds.variables["split"].values} - set(SPLITS))
        if bad:
            yield f"coordinate 'split': values {bad} are not in {list(SPLITS)}"
    if "replicate" in ds.coords:
        r = ds.variables["replicate"].values
        if not np.issubdtype(r.dtype, np.integer) or len(np.unique(r)) != len(r):
            yield "coordinate 'replicate': must be unique integers"
    yield from _check_time_coords(ds, ctx)


def _check_time_coords(ds: xr.Dataset, ctx: _Ctx) -> Iterator[str]:
    """``step`` is 1..T; a residual dataset's ``age`` is 0..T-1."""
    h = ctx.horizon
    if h is not None and "step" in ds.dims:
        if ds.sizes["step"] != h:
            yield f"dimension 'step' has length {ds.sizes['step']}, expected horizon = {h}"
        elif "step" not in ds.coords or not np.array_equal(ds.variables["step"].values, np.arange(1, h + 1)):
            yield f"coordinate 'step' must be 1..{h}"
    if ctx.kind == Kind.RESIDUAL and h is not None and "age" in ds.dims:
        if ds.sizes["age"] != h:
            yield f"dimension 'age' has length {ds.sizes['age']}, expected horizon = {h} (ages 0..T-1)"
        elif "age" not in ds.coords or not np.array_equal(ds.variables["age"].values, np.arange(h)):
            yield f"coordinate 'age' must be 0..{h - 1}"


def _check_logit_group(ds: xr.Dataset, kind: str) -> Iterator[str]:
    """The logit traces come whole: every field of every path of the kind, or none."""
    names = list(logit_var_dims(kind))
    have = [n for n in names if n in ds.data_vars]
    if have and len(have) < len(names):
        missing = [n for n in names if n not in ds.data_vars]
        yield (f"logit traces are partial: {len(have)} of {len(names)} variables present, missing {missing} "
               f"(they are all present or all absent)")


def _check_vars(ds: xr.Dataset, ctx: _Ctx) -> Iterator[str]:
    """Presence, dims and dtypes; well-formed variables go into ``ctx.dims`` (read later, per chunk)."""
    wanted = dict(REQUIRED_VARS[ctx.kind])
    optional = OPTIONAL_VARS.get(ctx.kind, {})
    for name, dims in list(wanted.items()) + [(k, v) for k, v in optional.items() if k in ds]:
        if name not in ds.data_vars:
            yield f"variable {name!r} is missing (required for kind {ctx.kind!r})"
            continue
        var = ds.variables[name]
        full = ctx.lead + dims
        if set(var.dims) != set(full) or len(var.dims) != len(full):
            yield f"variable {name!r} has dims {var.dims}, expected {full}"
            continue
        if name in ANSWER_STR_VARS:
            if var.dtype.kind not in "OU":
                yield f"variable {name!r} has dtype {var.dtype}, expected strings (object or unicode)"
                continue
            ctx.dims[name] = full
            continue
        want = _dtype(name)
        if var.dtype != want:
            yield f"variable {name!r} has dtype {var.dtype}, expected {np.dtype(want)}"
            continue
        ctx.dims[name] = full


def _dtype(name: str) -> Any:
    """The contract's dtype of a numeric variable."""
    if name in _TOKEN_VARS | _LOGIT_TOKEN_VARS or name == "x_answer_start":
        return TOKEN_DTYPE
    return SCORE_DTYPE if name in ANSWER_VARS else PROB_DTYPE


# ----------------------------------------------------------------------------- value rules

def _rule_tv_range(ctx: _Ctx) -> Iterator[str]:
    complete = ctx.kind in (Kind.COUPLED, Kind.REFERENCE)   # a reference trace's optional tv is every step
    for name in sorted(_TV_VARS & ctx.arrays.keys()):
        a = ctx.arrays[name]
        yield from _report(ctx, name, np.isinf(a) | (np.isfinite(a) & ((a < 0) | (a > 1))), "outside [0, 1]")
        if complete:
            yield from _report(ctx, name, np.isnan(a), f"missing (NaN): {ctx.kind} trajectories are complete")


def _rule_token_range(ctx: _Ctx) -> Iterator[str]:
    complete = ctx.kind in (Kind.COUPLED, Kind.REFERENCE)
    for name in sorted((_TOKEN_VARS - {"branch_step"}) & ctx.arrays.keys()):
        a = ctx.arrays[name]
        v = _lead(ctx.vocab, a.ndim)
        low = 0 if complete else MISSING_TOKEN
        bad = (a < low) | (a >= v)
        what = "outside [0, vocab_size)" if complete else "outside [0, vocab_size) and not -1"
        if complete:
            what += f" ({ctx.kind} trajectories are complete, no -1)"
        yield from _report(ctx, name, bad, what)


def _mismatch(ctx: _Ctx, tv: str, x: str, y: str, observed: np.ndarray | None = None) -> Iterator[str]:
    """Tokens that differ need TV > ctx.tv_atol (the coupling diverges with probability TV)."""
    if not {tv, x, y} <= ctx.arrays.keys():
        return
    t, xa, ya = ctx.arrays[tv], ctx.arrays[x], ctx.arrays[y]
    differ = (xa != ya) & (xa >= 0) & (ya >= 0)
    if observed is not None:
        differ &= observed
    bad = differ & (t <= ctx.tv_atol)      # NaN where observed is the mask rules' business
    yield from _report(ctx, tv, bad, f"<= {ctx.tv_atol:g} where {x} != {y}: "
                                     "the coupling cannot diverge at TV 0")


def _rule_mismatch(ctx: _Ctx) -> Iterator[str]:
    if ctx.kind == Kind.COUPLED:
        yield from _mismatch(ctx, "tv", "x_token", "y_token")
    elif ctx.kind == Kind.RESIDUAL:
        # Age 0 is a divergence *conditioned* on happening, legitimate at any TV > 0
        # (checked with the branch masks); later ages run the plain coupling again.
        if "branch_tv" in ctx.arrays:
            later = np.ones(ctx.arrays["branch_tv"].shape, dtype=bool)
            later[..., 0] = False
            yield from _mismatch(ctx, "branch_tv", "branch_x_token", "branch_y_token", later)
        if {"branch_x_token", "branch_y_token"} <= ctx.arrays.keys():
            bx, by = ctx.arrays["branch_x_token"][..., 0], ctx.arrays["branch_y_token"][..., 0]
            same = (bx == by) & (bx >= 0)
            yield from _report(ctx, "branch_x_token", _age0(ctx, same),
                               "equal to branch_y_token at age 0: the branches must differ at t*")


def _age0(ctx: _Ctx, mask: np.ndarray) -> np.ndarray:
    """Lift a (…, replicate) mask to (…, replicate, age) true only at age 0."""
    out = np.zeros(mask.shape + (ctx.arrays["branch_tv"].shape[-1] if "branch_tv" in ctx.arrays
                                 else ctx.arrays["branch_x_token"].shape[-1],), dtype=bool)
    out[..., 0] = mask
    return out


def _absorbing(ctx: _Ctx, name: str, problems: list[_Finding],
               observed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Check EOS is absorbing along the last axis of ``name`` (after the first EOS id,
    that same id); return 'strictly after the first EOS' and the id ended on (-1: none)."""
    a = ctx.arrays[name]
    is_eos = _eos_mask(ctx, a)
    after = _after(is_eos)
    first = np.take_along_axis(a, is_eos.argmax(axis=-1)[..., None], -1)
    end = np.where(is_eos.any(axis=-1, keepdims=True), first, -1)
    bad = after & (a != end)
    if observed is not None:
        bad &= observed
    problems += _report(ctx, name, bad, "not EOS after an earlier EOS (EOS is absorbing: the id of the first)")
    return after, end


def _both_same(x: tuple[np.ndarray, np.ndarray], y: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """After both sides ended on the same EOS id (both laws its point mass, so TV 0); sides
    ended on different ids keep emitting two different tokens (TV 1)."""
    return x[0] & y[0] & (x[1] == y[1])


def _rule_eos(ctx: _Ctx) -> Iterator[str]:
    """EOS is absorbing; once both sides are EOS both laws are the EOS point mass (TV 0, log 1 = 0)."""
    if np.all(np.asarray(ctx.eos) < 0):
        return
    out: list[_Finding] = []
    arr = ctx.arrays
    if ctx.kind == Kind.COUPLED and {"x_token", "y_token"} <= arr.keys():
        both = _both_same(_absorbing(ctx, "x_token", out), _absorbing(ctx, "y_token", out))
        if "tv" in arr:
            out += _report(ctx, "tv", both & (arr["tv"] != 0),
                           "nonzero after both sides emitted the same EOS (both laws are its point mass)")
    elif ctx.kind == Kind.REFERENCE and "x_token" in arr:
        after, _ = _absorbing(ctx, "x_token", out)
        for name in ("x_logp", "x_logq", "tv"):
            if name in arr:
                out += _report(ctx, name, after & (arr[name] != 0),
                               "nonzero after EOS (both laws are then the EOS point mass, log 1 = 0)")
    elif ctx.kind == Kind.RESIDUAL:
        # The branches continue the shared history z_<t*; that prefix holds no EOS because
        # TV is 0 after a shared EOS and t* needs TV > 0 (checked with the branch masks).
        if "shared_token" in arr:
            after, _ = _absorbing(ctx, "shared_token", out)
            if "shared_tv" in arr:
                out += _report(ctx, "shared_tv", after & (arr["shared_tv"] != 0),
                               "nonzero after the shared path emitted EOS")
        if {"branch_x_token", "branch_y_token"} <= arr.keys():
            bx, by = arr["branch_x_token"], arr["branch_y_token"]
            both = _both_same(_absorbing(ctx, "branch_x_token", out, bx >= 0),
                              _absorbing(ctx, "branch_y_token", out, by >= 0))
            if "branch_tv" in arr:
                bt = arr["branch_tv"]
                out += _report(ctx, "branch_tv", both & ~np.isnan(bt) & (bt != 0),
                               "nonzero after both branches emitted the same EOS")
    yield from out


def _rule_shared_path(ctx: _Ctx) -> Iterator[str]:
    """The survival path: an observed prefix of steps, ending early only at a step with TV = 1.

    The step where the path stops keeps its TV (1, up to ``STOP_TV_ATOL``: float32
    rounding of a TV of 1) with token -1, since min(p, q) has no mass to draw Z
    from; later steps are NaN / -1. A path may also stop at step T itself (then only
    its token is -1). A TV that rounds to 1 while a little overlap mass is left may
    carry a token and let the path continue.
    """
    if ctx.kind != Kind.RESIDUAL or not {"shared_tv", "shared_token"} <= ctx.arrays.keys():
        return
    tv, tok = ctx.arrays["shared_tv"], ctx.arrays["shared_token"]
    seen = ~np.isnan(tv)
    gone = _after(~seen) | ~seen                       # at or after the first NaN
    yield from _report(ctx, "shared_tv", gone & seen, "observed after an earlier NaN step (the survival "
                                                      "path is observed from step 1 until it stops)")
    # The last observed step of each path, and whether the path ended there.
    last = seen & ~np.concatenate([seen[..., 1:], np.zeros_like(seen[..., :1])], axis=-1)
    stop = last & (tok == MISSING_TOKEN)
    ended_early = last & ~seen.all(axis=-1, keepdims=True)
    yield from _report(ctx, "shared_token", ~seen & (tok != MISSING_TOKEN),
                       "observed where shared_tv is NaN (after the survival path stopped)")
    yield from _report(ctx, "shared_token", seen & ~last & (tok == MISSING_TOKEN),
                       "-1 while the survival path is running (only its last step may lack a token)")
    yield from _report(ctx, "shared_token", ended_early & (tok != MISSING_TOKEN),
                       "not -1 at the step where the survival path stopped (min(p, q) is empty at TV 1)")
    yield from _report(ctx, "shared_tv", (stop | ended_early) & ~(tv >= 1 - STOP_TV_ATOL),
                       f"< 1 at the step where the survival path stopped (tolerance {STOP_TV_ATOL:g})")


def _rule_branch_masks(ctx: _Ctx) -> Iterator[str]:
    """branch_step in 0..T; ages 0..K observed with K = min(W, T - t*), later ages unobserved."""
    need = {"branch_step", "branch_tv", "branch_x_token", "branch_y_token"}
    if ctx.kind != Kind.RESIDUAL or not need <= ctx.arrays.keys() or ctx.horizon is None or ctx.window is None:
        return
    t_star = ctx.arrays["branch_step"]
    T, W = ctx.horizon, ctx.window
    yield from _report(ctx, "branch_step", (t_star < 0) | (t_star > T), f"outside 0..{T}")
    ages = np.arange(ctx.arrays["branch_tv"].shape[-1])
    K = np.minimum(W, T - t_star)[..., None]
    expect = (t_star[..., None] >= 1) & (t_star[..., None] <= T) & (ages <= K)
    rule = f"(ages 0..K observed, K = min(window={W}, T - branch_step); none when branch_step = 0)"
    for name in ("branch_tv", "branch_x_token", "branch_y_token"):
        a = ctx.arrays[name]
        seen = ~np.isnan(a) if name == "branch_tv" else a != MISSING_TOKEN
        yield from _report(ctx, name, expect & ~seen, "missing where observed is required " + rule)
        yield from _report(ctx, name, ~expect & seen, "observed where it must be unobserved " + rule)
    yield from _branch_vs_shared(ctx, t_star)


def _branch_vs_shared(ctx: _Ctx, t_star: np.ndarray) -> Iterator[str]:
    """t* is a step of the shared path with TV > 0, and branch_tv[age 0] is that same TV."""
    if "shared_tv" not in ctx.arrays:
        return
    tv = ctx.arrays["shared_tv"]
    T = tv.shape[-1]
    valid = (t_star >= 1) & (t_star <= T)
    at = np.take_along_axis(tv, np.clip(t_star - 1, 0, T - 1)[..., None].astype(np.intp), axis=-1)[..., 0]
    # t* ~ pi_t / (1 - S_T) conditions on divergence: any TV > 0 (however small) may be t*.
    yield from _report(ctx, "branch_step", valid & ~(at > 0),
                       "at a step where the shared path is unobserved or has TV 0 (divergence there is impossible)")
    b0 = ctx.arrays["branch_tv"][..., 0]
    yield from _report(ctx, "branch_tv", _age0(ctx, valid & (b0 <= 0)),
                       "0 at age 0, where the branches diverge (TV must be > 0)")
    off = valid & (at > 0) & ~np.isnan(b0) & ~np.isclose(b0, at, rtol=BRANCH_TV_RTOL, atol=TV_ZERO_ATOL)
    yield from _report(ctx, "branch_tv", _age0(ctx, off),
                       "at age 0 differs from shared_tv at branch_step (the same two laws)")
    # No branch although some step could diverge: 1 - S_T > 0 means a branch must be drawn.
    possible = np.where(np.isnan(tv), 0.0, tv).max(axis=-1) > ctx.tv_atol
    yield from _report(ctx, "branch_step", (t_star == 0) & possible,
                       "0 although the shared path has a step with TV > 0 (divergence was possible)")


def _rule_logp(ctx: _Ctx) -> Iterator[str]:
    """log p of a sampled token is finite and <= 0; log q may be -inf (q = 0) but not NaN."""
    for name in ("x_logp", "y_logp", "x_logq"):
        if name not in ctx.arrays:
            continue
        a = ctx.arrays[name]
        finite_needed = name != "x_logq"
        if finite_needed:
            yield from _report(ctx, name, ~np.isfinite(a),
                               "not finite (the token was sampled from this law, so its probability is > 0)")
        else:
            yield from _report(ctx, name, np.isnan(a) | (a == np.inf), "NaN or +inf (-inf is allowed: q = 0)")
        yield from _report(ctx, name, np.isfinite(a) & (a > LOGP_ATOL),
                           f"> 0 (a log-probability; tolerance {LOGP_ATOL:g})")


def _first_top(mask: np.ndarray, k: int) -> np.ndarray:
    """A per-row mask lifted onto the ``top`` axis, true at the row's first entry only."""
    out = np.zeros(mask.shape + (k,), dtype=bool)
    out[..., 0] = mask
    return out


def _rule_logits(ctx: _Ctx) -> Iterator[str]:
    """The logit traces (protocols.logit_fields): observed exactly where the path's TV is; ids in the
    vocabulary and distinct; log-probabilities <= 0, each top-k sorted most likely first and of total
    mass <= 1; KL and entropies >= 0, entropies <= log V."""
    tv_of = {"": "tv", "shared_": "shared_tv", "branch_": "branch_tv"}
    for prefix in logit_prefixes(ctx.kind):
        names = {n: prefix + n for n in LOGIT_FIELDS}
        if not set(names.values()) <= ctx.arrays.keys():
            continue
        arr = {n: ctx.arrays[full] for n, full in names.items()}
        seen = ~np.isnan(arr["entropy_p"])
        base = tv_of[prefix] if ctx.kind != Kind.REFERENCE else None
        if base in ctx.arrays:
            expect = ~np.isnan(ctx.arrays[base])
            yield from _report(ctx, names["entropy_p"], expect & ~seen, f"missing where {base} is observed")
            yield from _report(ctx, names["entropy_p"], ~expect & seen, f"observed where {base} is NaN")
        k = arr["p_top_logp"].shape[-1]
        for n in LOGIT_FIELDS:
            a, full = arr[n], names[n]
            rows = seen[..., None] if n in LOGIT_TOP else seen
            if n in LOGIT_TOKENS:
                v = _lead(ctx.vocab, a.ndim)
                yield from _report(ctx, full, rows & ((a < 0) | (a >= v)), "outside [0, vocab_size) in an observed row")
                yield from _report(ctx, full, ~rows & (a != MISSING_TOKEN), "not -1 in an unobserved row")
                ids = np.sort(a, axis=-1)
                dup = (ids[..., 1:] == ids[..., :-1]).any(axis=-1) & seen
                yield from _report(ctx, full, _first_top(dup, k), "repeating a token id within one top-k")
                continue
            yield from _report(ctx, full, ~rows & ~np.isnan(a), "not NaN in an unobserved row")
            if n in LOGIT_TOP:
                yield from _report(ctx, full, rows & (np.isnan(a) | (a == np.inf)),
                                   "NaN or +inf in an observed row (-inf is allowed: probability 0)")
                yield from _report(ctx, full, rows & (a > LOGP_ATOL),
                                   f"> 0 (a log-probability; tolerance {LOGP_ATOL:g})")
                with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                    lse = np.log(np.exp(np.where(np.isnan(a), -np.inf, a).astype(np.float64)).sum(axis=-1))
                yield from _report(ctx, full, _first_top(seen & (lse > LSE_ATOL), k),
                                   f"with log-sum-exp over the top-k > 0 (more than all the mass; "
                                   f"tolerance {LSE_ATOL:g})")
            else:
                low = "+inf (KL is +inf where the first law has mass the second lacks)" if n.startswith("kl_") \
                    else "+inf"
                yield from _report(ctx, full, seen & (np.isnan(a) | (n.startswith("entropy") & np.isinf(a))),
                                   "NaN or infinite in an observed row" if n.startswith("entropy")
                                   else f"NaN in an observed row ({low} is allowed)")
                yield from _report(ctx, full, seen & (a < -KL_ATOL), f"< 0 (tolerance {KL_ATOL:g})")
                if n.startswith("entropy"):
                    logv = np.log(_lead(ctx.vocab, a.ndim).astype(np.float64))
                    yield from _report(ctx, full, seen & (a > logv + KL_ATOL), "> log(vocab_size)")
        for n in ("p_top_logp", "q_top_logq"):
            a = arr[n]
            with np.errstate(invalid="ignore"):
                rise = np.zeros(a.shape, dtype=bool)
                rise[..., 1:] = a[..., 1:] > a[..., :-1] + LOGP_ATOL
            yield from _report(ctx, names[n], rise & seen[..., None],
                               "not sorted: larger than the entry before it (a top-k is most likely first)")


def _answers_json(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per document: the value is a JSON list of strings; the list is empty."""
    bad = np.zeros(a.shape, dtype=bool)
    empty = np.zeros(a.shape, dtype=bool)
    for i, text in enumerate(a.ravel().tolist()):   # one JSON document per doc: no vectorised parser
        try:
            value = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            value = None
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
        bad.flat[i], empty.flat[i] = not ok, ok and not value
    return bad, empty


def _rule_answers(ctx: _Ctx) -> Iterator[_Finding]:
    """The answer variables (docs/contract.md "Answers"): scores and depths in [0, 1] or NaN; the
    answer start -1 or a step; strings are strings; ``answers`` a JSON list of strings, and no
    score where it is empty (nothing to score against)."""
    arr = ctx.arrays
    for name in ("x_score", "y_score", "needle_depth"):
        if name in arr:
            a = arr[name]
            yield from _report(ctx, name, np.isinf(a) | (np.isfinite(a) & ((a < 0) | (a > 1))),
                               "outside [0, 1] (NaN = not scored)" if name != "needle_depth"
                               else "outside [0, 1] (NaN = no needle)")
    if "x_answer_start" in arr:
        a = arr["x_answer_start"]
        top = ctx.horizon if ctx.horizon is not None else np.iinfo(np.int64).max
        yield from _report(ctx, "x_answer_start", (a < -1) | (a >= top),
                           f"outside -1..{top - 1} (a step index, -1 = not located)" if ctx.horizon is not None
                           else "below -1 (-1 = not located)")
    for name in ANSWER_STR_VARS:
        if name in arr and arr[name].dtype == object:
            yield from _report(ctx, name, ~np.frompyfunc(lambda v: isinstance(v, str), 1, 1)(arr[name]).astype(bool),
                               "not a string")
    if "answers" in arr:
        bad, empty = _answers_json(arr["answers"])
        yield from _report(ctx, "answers", bad, "not a JSON list of strings")
        for name in ("x_score", "y_score"):
            if name in arr:
                lead = empty.reshape(empty.shape + (1,) * (arr[name].ndim - empty.ndim))
                yield from _report(ctx, name, lead & ~np.isnan(arr[name]),
                                   "scored where the document's answers are [] (nothing to score against: NaN)")


_VALUE_RULES: tuple[Callable[[_Ctx], Iterator[_Finding]], ...] = (
    _rule_tv_range, _rule_token_range, _rule_mismatch, _rule_eos, _rule_shared_path, _rule_branch_masks,
    _rule_logp, _rule_logits, _rule_answers,
)


# ----------------------------------------------------------------------------- chunks

def _chunk_findings(ctx: _Ctx, part: xr.Dataset | DocChunk) -> list[_Finding]:
    """Every value rule on one chunk of documents (a ``DocChunk`` is read here, inside the task)."""
    offset = 0
    if isinstance(part, DocChunk):
        part, offset = part.load(), part.start
    # Variables, not DataArrays: the same values without building each one's coordinates
    # (which was most of validate's time on a small dataset)
    arrays = {name: part.variables[name].transpose(*dims).values for name, dims in ctx.dims.items()}
    chunk = replace(ctx, arrays=arrays, offset=offset)
    return [f for rule in _VALUE_RULES for f in rule(chunk)]


def _merge(chunks: list[list[_Finding]]) -> list[_Finding]:
    """Per-chunk findings -> one per rule and variable: counts summed, the first example kept."""
    merged = []
    for same in zip(*chunks, strict=True):
        hits = [f for f in same if f.count]
        if hits:
            first = min(hits, key=lambda f: f.index)
            merged.append(_Finding(first.name, first.what, sum(f.count for f in hits), first.index, first.value))
    return merged


def _value_problems(ds: xr.Dataset, ctx: _Ctx) -> list[Problem]:
    """The value rules over every document chunk (one chunk when ``ds`` is in memory)."""
    names = list(ctx.dims)
    if not names:
        return []
    if "doc" not in ds.dims or not is_lazy(ds):
        findings = [_chunk_findings(ctx, ds)]
    else:
        import dask  # a dask-backed dataset implies dask is installed

        tasks = [dask.delayed(_chunk_findings)(ctx, chunk) for chunk in doc_chunks(ds, names)]
        findings = list(dask.compute(*tasks))
    return [_problem(ds, ctx.dims[f.name], f) for f in _merge(findings)]


# ----------------------------------------------------------------------------- entry point

def _per_model(ds: xr.Dataset, name: str, default: Any) -> Any:
    """A per-model coordinate (datasets combined across models) shaped to lead the data."""
    if "model" in ds.dims and name in ds.coords and ds.coords[name].dims == ("model",):
        return ds.coords[name].values.astype(np.int64)
    return default


def _eos_of(ds: xr.Dataset) -> np.ndarray:
    """The EOS table (``protocols.schema.eos_table``); no EOS where the attrs are malformed
    (those are reported by the attribute checks)."""
    try:
        return eos_table(ds)
    except (TypeError, ValueError):
        return np.array([-1], dtype=np.int64)


def validate(ds: xr.Dataset, *, source: str | None = None, tv_atol: float = TV_ZERO_ATOL) -> xr.Dataset:
    """Check ``ds`` against ``kvdiv.trace/1`` (docs/contract.md §1) and return it unchanged.

    Parameters
    ----------
    ds : xarray.Dataset
        A ``coupled``, ``residual``, ``reference`` or ``answers`` dataset.
    source : str, optional
        Where it came from (e.g. a file name), added to the error message.
    tv_atol : float, default TV_ZERO_ATOL
        The TV at or below which a token mismatch counts as impossible (module
        docstring); pass 0.0 for the exact rule "tokens differ => TV > 0".
        A dask-backed ``ds`` is checked document chunk by document chunk in
        bounded memory; counts are summed and the example is the first bad value
        of the whole dataset.

    Returns
    -------
    xarray.Dataset
        ``ds`` itself, so calls chain: ``validate(build(...))``.

    Raises
    ------
    TraceValidationError
        Listing every problem at once (``.problems``), each naming the variable
        or attribute, the count of bad values and one example index.
    TypeError
        ``ds`` is not an ``xarray.Dataset``.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> ds = validate(example_dataset("coupled"))
    >>> bad = ds.assign(tv=ds.tv.where(ds.step != 2, 1.5))
    >>> try:
    ...     validate(bad)
    ... except TraceValidationError as err:
    ...     print(err.problems[0])
    tv: 16 value(s) outside [0, 1], e.g. tv[doc='doc000', policy='snapkv@0.5', replicate=0, step=2] = 1.5
    """
    if not isinstance(ds, xr.Dataset):
        raise TypeError(f"validate expects an xarray.Dataset, got {type(ds).__name__}")
    problems = list(_check_attrs(ds))
    kind = ds.attrs.get("kind")
    if kind in KINDS:
        a = ds.attrs
        ctx = _Ctx(
            kind=kind,
            horizon=int(a["horizon"]) if _is_int(a.get("horizon")) else None,
            window=int(a["window"]) if _is_int(a.get("window")) else None,
            vocab=_per_model(ds, "vocab_size", a.get("vocab_size") if _is_int(a.get("vocab_size")) else np.inf),
            eos=_eos_of(ds),
            lead=("model",) if "model" in ds.dims else (), tv_atol=float(tv_atol),
        )
        problems += list(_check_coords(ds, ctx))
        problems += list(_check_vars(ds, ctx))
        if kind in TRACE_KINDS:
            problems += list(_check_logit_group(ds, kind))
        problems += _value_problems(ds, ctx)
    if problems:
        raise TraceValidationError([p if isinstance(p, Problem) else Problem(p) for p in problems], source)
    return ds

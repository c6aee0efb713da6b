"""The ``kvdiv.trace/1`` layout: constants and one builder per kind.

A trace dataset is an ``xarray.Dataset`` with named dims ``doc``, ``policy``,
``replicate``, ``step`` (1..T) and, for residual traces, ``age`` (0..T-1).
The builders take plain numpy arrays shaped ``(doc, policy, replicate, step)``
(or ``(..., age)``) and fill in coordinates, dtypes and attributes, so that a
producer only has to supply the numbers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from protocols.kinds import KINDS
from protocols.logit_fields import FIELD_DOCS, PATH_DOCS, logit_var_dims
from protocols.policies import policy_coords
from protocols.version import __version__

__all__ = [
    "ANSWER_STR_VARS", "ANSWER_VARS", "COUPLING", "KINDS", "MISSING_TOKEN", "OPTIONAL_VARS", "PER_MODEL_COORDS",
    "PROB_DTYPE", "REQUIRED_ATTRS", "REQUIRED_ATTRS_BY_KIND", "REQUIRED_VARS", "SCORE_DTYPE", "answer_variables",
    "answers_dataset",
    "SCHEMA", "SPLITS", "TOKEN_DTYPE", "VARIABLE_DOCS", "coupled_dataset", "eos_ids", "eos_set", "eos_table",
    "reference_dataset", "residual_dataset", "sampling_params",
]

SCHEMA = "kvdiv.trace/1"
COUPLING = "stepwise-maximal"
SPLITS = ("exploratory", "confirmatory", "")

TOKEN_DTYPE = np.int32
PROB_DTYPE = np.float32
MISSING_TOKEN = -1

#: Data variables each kind must carry, with their dims.
REQUIRED_VARS: dict[str, dict[str, tuple[str, ...]]] = {
    "coupled": {
        "tv": ("doc", "policy", "replicate", "step"),
        "x_token": ("doc", "policy", "replicate", "step"),
        "y_token": ("doc", "policy", "replicate", "step"),
    },
    "residual": {
        "shared_tv": ("doc", "policy", "replicate", "step"),
        "shared_token": ("doc", "policy", "replicate", "step"),
        "branch_step": ("doc", "policy", "replicate"),
        "branch_tv": ("doc", "policy", "replicate", "age"),
        "branch_x_token": ("doc", "policy", "replicate", "age"),
        "branch_y_token": ("doc", "policy", "replicate", "age"),
    },
    "reference": {
        "x_token": ("doc", "policy", "replicate", "step"),
        "x_logp": ("doc", "policy", "replicate", "step"),
        "x_logq": ("doc", "policy", "replicate", "step"),
    },
    # task scores without tokens (a leaderboard's predictions, docs/contract.md "Answers")
    "answers": {
        "x_score": ("doc", "policy", "replicate"),
        "y_score": ("doc", "policy", "replicate"),
    },
}

#: The task-answer variables (docs/contract.md "Answers"): optional in ``coupled``, the
#: scores required in ``answers``. Scores are float64 in [0, 1] (NaN: not scored), texts
#: and per-doc labels are strings, ``answers`` a JSON list of strings per document.
ANSWER_VARS: dict[str, tuple[str, ...]] = {
    "x_score": ("doc", "policy", "replicate"),
    "y_score": ("doc", "policy", "replicate"),
    "x_text": ("doc", "policy", "replicate"),
    "y_text": ("doc", "policy", "replicate"),
    "x_answer_start": ("doc", "policy", "replicate"),
    "answers": ("doc",),
    "scorer": ("doc",),
    "task": ("doc",),
    "needle_depth": ("doc",),
}
#: dtype kind per answer variable: float64, str (object or unicode), int32.
SCORE_DTYPE = np.float64
ANSWER_STR_VARS = ("x_text", "y_text", "answers", "scorer", "task")

#: Optional variables recognised by validation (others are allowed and ignored); the
#: logit traces (:mod:`protocols.logit_fields`) are optional in every kind.
OPTIONAL_VARS: dict[str, dict[str, tuple[str, ...]]] = {
    "coupled": {
        "x_logp": ("doc", "policy", "replicate", "step"),
        "y_logp": ("doc", "policy", "replicate", "step"),
    },
    "residual": {},
    # the step's TV between P's and Q's laws on the sampled history (streamed by the server)
    "reference": {"tv": ("doc", "policy", "replicate", "step")},
    "answers": {k: v for k, v in ANSWER_VARS.items() if k not in ("x_score", "y_score", "x_answer_start")},
}
for _kind, _optional in OPTIONAL_VARS.items():
    if _kind != "answers":  # no tokens, so no logit traces
        _optional.update(logit_var_dims(_kind))
del _kind, _optional
OPTIONAL_VARS["coupled"].update(ANSWER_VARS)

#: Attributes every trace kind (coupled, residual, reference) must carry.
REQUIRED_ATTRS = (
    "schema", "kind", "horizon", "vocab_size", "window", "coupling",
    "eos_token_id", "model", "sampling", "producer",
)
#: Attributes per kind: an ``answers`` dataset has no tokens, so no horizon, vocabulary,
#: window, EOS or coupling; ``sampling`` is optional there (a JSON object when present).
REQUIRED_ATTRS_BY_KIND: dict[str, tuple[str, ...]] = {
    **{k: REQUIRED_ATTRS for k in ("coupled", "residual", "reference")},
    "answers": ("schema", "kind", "model", "producer"),
}

VARIABLE_DOCS: dict[str, str] = {
    "tv": "TV distance between the two next-token laws at this step (coupled histories)",
    "x_token": "token emitted by the reference (full-cache) model P",
    "y_token": "token emitted by the candidate (evicted-cache) model Q",
    "x_logp": "log p_t(x_t): log-probability of the P token under P",
    "y_logp": "log q_t(y_t): log-probability of the Q token under Q",
    "x_logq": "log q_t(x_t): log-probability of the P token under Q",
    "shared_tv": "TV on the shared survival path; NaN after the path stops",
    "shared_token": "token Z_t drawn from min(p,q)/(1-TV) on the survival path; -1 where none",
    "branch_step": "branch point t* (1..T); 0 when divergence is impossible",
    "branch_tv": "TV between the two branches' laws at age k = t - t*; NaN where unobserved",
    "branch_x_token": "P-branch token at age k; -1 where unobserved",
    "branch_y_token": "Q-branch token at age k; -1 where unobserved",
    **{prefix + name: text + where for prefix, where in PATH_DOCS.items() for name, text in FIELD_DOCS.items()},
    "x_score": "task score of P's answer in [0, 1] (the document's scorer against its answers); NaN = not scored",
    "y_score": "task score of Q's answer in [0, 1] (the document's scorer against its answers); NaN = not scored",
    "x_text": "P's answer decoded with the model's tokenizer (special tokens and EOS left out)",
    "y_text": "Q's answer decoded with the model's tokenizer (special tokens and EOS left out)",
    "x_answer_start": "step index (0-based) of P's token where its scored answer starts; -1 = not located",
    "answers": "the document's acceptable answers: a JSON list of strings",
    "scorer": "the scorer's name (protocols.scoring)",
    "task": "the task the document belongs to (passkey, multikey, ...; '' = none)",
    "needle_depth": "where the needle sits in the context, 0 = start, 1 = end (needle tasks; NaN otherwise)",
}


#: per-doc coordinates that may differ between models (each model's tokenizer counts its own
#: prompt): combined along ``model`` they become (``model``, ``doc``) coordinates
PER_MODEL_COORDS = ("prompt_tokens",)


def eos_ids(attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """Every EOS id declared by a dataset's attrs or a wire header, in order.

    ``eos_token_ids`` (an int list; netCDF hands a one-element list back as a
    scalar) when present, else ``eos_token_id`` (-1 or None: no EOS), so files
    written before the list existed read as a one-id set.

    Parameters
    ----------
    attrs : mapping
        Dataset attributes or a header record.

    Returns
    -------
    tuple of int
        The EOS ids, empty for none (negative entries are dropped).

    Raises
    ------
    TypeError, ValueError
        An entry that is not an integer.

    Examples
    --------
    >>> eos_ids({"eos_token_id": 2, "eos_token_ids": [2, 7, 9]}), eos_ids({"eos_token_id": 2})
    ((2, 7, 9), (2,))
    >>> eos_ids({"eos_token_id": -1})
    ()
    """
    ids = attrs.get("eos_token_ids")
    if ids is None:
        ids = attrs.get("eos_token_id")
    if ids is None:
        return ()
    return tuple(int(i) for i in np.atleast_1d(np.asarray(ids)).ravel() if int(i) >= 0)


def eos_set(eos_token_id: int | None, eos_token_ids: Sequence[int] | None) -> tuple[int, ...]:
    """The EOS set a builder was given: ``eos_token_ids``, else ``eos_token_id`` (None: none).

    Parameters
    ----------
    eos_token_id : int or None
        The (first) EOS id; None or -1 for none.
    eos_token_ids : sequence of int or None
        Every EOS id, or None to use ``eos_token_id`` alone.

    Returns
    -------
    tuple of int
        The distinct ids in order.

    Raises
    ------
    ValueError
        ``eos_token_id`` is given, is not -1 and is not in ``eos_token_ids``.

    Examples
    --------
    >>> eos_set(None, [9, 2, 9]), eos_set(2, None), eos_set(None, None)
    ((9, 2), (2,), ())
    """
    if eos_token_ids is None:
        return () if eos_token_id is None or int(eos_token_id) < 0 else (int(eos_token_id),)
    ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
    if eos_token_id is not None and int(eos_token_id) >= 0 and int(eos_token_id) not in ids:
        raise ValueError(f"eos_token_id {eos_token_id} is not one of eos_token_ids {list(ids)}")
    return ids


def eos_table(ds: xr.Dataset) -> np.ndarray:
    """A dataset's EOS ids as int64, padded with -1 (no EOS: ``[-1]``).

    Shape ``(k,)``; ``(n_model, k)`` for a dataset combined across models, whose
    per-model coordinates (``eos_token_ids`` on (model, eos), else ``eos_token_id``
    on model) take precedence over the attrs.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.

    Returns
    -------
    numpy.ndarray
        int64 ids, -1 padded.

    Raises
    ------
    TypeError, ValueError
        An EOS attribute that is not integers.

    Examples
    --------
    >>> eos_table(xr.Dataset(attrs={"eos_token_id": 2, "eos_token_ids": [2, 9]})).tolist()
    [2, 9]
    """
    if "model" in ds.dims:
        for name in ("eos_token_ids", "eos_token_id"):
            if name in ds.coords and ds.coords[name].dims[:1] == ("model",) and ds.coords[name].ndim <= 2:
                v = np.asarray(ds.coords[name].values, dtype=np.int64)
                return v.reshape(v.shape[0], -1)
    ids = eos_ids(ds.attrs)
    return np.array(ids or (-1,), dtype=np.int64)


def _producer() -> str:
    return f"kvdiv {__version__}"


def _sampling_json(sampling: Mapping[str, Any] | str | None) -> str:
    if sampling is None:
        return json.dumps({"temperature": 1.0, "top_k": 0, "top_p": 1.0})
    if isinstance(sampling, str):
        json.loads(sampling)  # must be valid JSON
        return sampling
    return json.dumps(dict(sampling), sort_keys=True)


def _as4(name: str, arr: Any, dtype: Any) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim == 2:  # (replicate, step) for one doc and one policy
        a = a[None, None]
    if a.ndim != 4:
        raise ValueError(
            f"{name}: expected an array shaped (doc, policy, replicate, step) "
            f"or (replicate, step), got shape {a.shape}"
        )
    return a.astype(dtype, copy=False)


def _coords(
    n_doc: int,
    n_pol: int,
    n_rep: int,
    docs: Sequence[str] | None,
    policies: Sequence[str] | None,
    split: Sequence[str] | None,
    prompt_tokens: Sequence[int] | None,
    press: Sequence[str] | None,
    retention: Sequence[float] | None,
    budget: Sequence[int] | None,
) -> dict[str, Any]:
    docs = [str(d) for d in (docs if docs is not None else [f"doc{i}" for i in range(n_doc)])]
    policies = [str(p) for p in (policies if policies is not None else ["candidate"] * n_pol)]
    if len(docs) != n_doc:
        raise ValueError(f"docs: {len(docs)} ids for {n_doc} documents")
    if len(policies) != n_pol:
        raise ValueError(f"policies: {len(policies)} ids for {n_pol} policies")
    parsed = [policy_coords(p) for p in policies]
    press = list(press) if press is not None else [p[0] for p in parsed]
    retention = list(retention) if retention is not None else [p[1] for p in parsed]
    budget = list(budget) if budget is not None else [p[2] for p in parsed]
    split = list(split) if split is not None else [""] * n_doc
    prompt_tokens = list(prompt_tokens) if prompt_tokens is not None else [0] * n_doc
    return {
        "doc": ("doc", np.array(docs, dtype=object)),
        "split": ("doc", np.array([str(s) for s in split], dtype=object)),
        "prompt_tokens": ("doc", np.asarray(prompt_tokens, dtype=np.int32)),
        "policy": ("policy", np.array(policies, dtype=object)),
        "press": ("policy", np.array([str(p) for p in press], dtype=object)),
        "retention": ("policy", np.asarray(retention, dtype=np.float64)),
        "budget": ("policy", np.asarray(budget, dtype=np.int32)),
        "replicate": ("replicate", np.arange(n_rep, dtype=np.int32)),
    }


def _attrs(
    kind: str,
    horizon: int,
    vocab_size: int,
    window: int,
    eos_token_id: int | None,
    model: str,
    sampling: Mapping[str, Any] | str | None,
    producer: str | None,
    extra: Mapping[str, Any] | None,
    eos_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    eos = eos_set(eos_token_id, eos_token_ids)
    attrs = {
        "schema": SCHEMA,
        "kind": kind,
        "horizon": int(horizon),
        "vocab_size": int(vocab_size),
        "window": int(window),
        "coupling": COUPLING,
        "eos_token_id": eos[0] if eos else -1,
        "model": str(model),
        "sampling": _sampling_json(sampling),
        "producer": producer or _producer(),
    }
    if len(eos) > 1:  # one id stays the old layout: eos_token_id alone
        attrs["eos_token_ids"] = list(eos)
    attrs.update(extra or {})
    return attrs


def _var(dims: tuple[str, ...], data: np.ndarray, name: str) -> xr.Variable:
    return xr.Variable(dims, data, attrs={"description": VARIABLE_DOCS.get(name, "")})


def coupled_dataset(
    tv: Any,
    x_token: Any,
    y_token: Any,
    *,
    vocab_size: int,
    docs: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
    eos_token_id: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    model: str = "",
    sampling: Mapping[str, Any] | str | None = None,
    producer: str | None = None,
    x_logp: Any = None,
    y_logp: Any = None,
    split: Sequence[str] | None = None,
    prompt_tokens: Sequence[int] | None = None,
    press: Sequence[str] | None = None,
    retention: Sequence[float] | None = None,
    budget: Sequence[int] | None = None,
    attrs: Mapping[str, Any] | None = None,
) -> xr.Dataset:
    """Build a ``coupled`` trace dataset from arrays shaped (doc, policy, replicate, step).

    Parameters
    ----------
    tv, x_token, y_token : array_like
        TV of the two next-token laws and the tokens of P and Q at each step,
        shaped (doc, policy, replicate, step) or (replicate, step) for one doc and
        one policy. Cast to float32 / int32.
    vocab_size : int
        Size of the models' vocabulary (attr ``vocab_size``).
    docs, policies : sequence of str, optional
        Ids along ``doc`` and ``policy`` (default ``doc0, doc1, ...`` and
        ``candidate``); each policy id also gives the ``press``, ``retention`` and
        ``budget`` coordinates through :func:`protocols.policies.policy_coords`.
    eos_token_id : int, optional
        The EOS token, or None (stored as -1) when EOS is not absorbing.
    eos_token_ids : sequence of int, optional
        Every EOS id when the model has several (each absorbing: a side that
        emits one keeps emitting it); stored as attr ``eos_token_ids`` when
        there are more than one, with ``eos_token_id`` = the first.
    model, producer : str, optional
        Attrs naming the model and the program that produced the traces.
    sampling : mapping or JSON str, optional
        Sampling parameters, stored as a JSON object (default temperature 1,
        no top-k / top-p).
    split, prompt_tokens : sequence, optional
        Per-doc coordinates (default ``""`` and 0).
    press, retention, budget : sequence, optional
        Per-policy coordinates overriding the ones parsed from the policy ids.
    attrs : mapping, optional
        Extra attributes, added after (and able to override) the contract's.
    x_logp, y_logp : array_like, optional
        log p_t(x_t) and log q_t(y_t), the optional coupled variables.

    Returns
    -------
    xarray.Dataset
        The dataset (not validated: call :func:`protocols.validate.validate`).
        Its window equals the horizon: coupled trajectories are complete.

    Raises
    ------
    ValueError
        An array of the wrong rank, or id lists of the wrong length.

    Examples
    --------
    >>> import numpy as np
    >>> ds = coupled_dataset(np.zeros((2, 3)), np.ones((2, 3)), np.ones((2, 3)), vocab_size=4)
    >>> dict(ds.sizes)
    {'doc': 1, 'policy': 1, 'replicate': 2, 'step': 3}
    >>> ds.attrs["kind"], ds.attrs["window"]
    ('coupled', 3)
    """
    tv = _as4("tv", tv, PROB_DTYPE)
    xt = _as4("x_token", x_token, TOKEN_DTYPE)
    yt = _as4("y_token", y_token, TOKEN_DTYPE)
    n_doc, n_pol, n_rep, horizon = tv.shape
    dims = REQUIRED_VARS["coupled"]["tv"]
    data = {"tv": _var(dims, tv, "tv"), "x_token": _var(dims, xt, "x_token"),
            "y_token": _var(dims, yt, "y_token")}
    for name, arr in (("x_logp", x_logp), ("y_logp", y_logp)):
        if arr is not None:
            data[name] = _var(dims, _as4(name, arr, PROB_DTYPE), name)
    coords = _coords(n_doc, n_pol, n_rep, docs, policies, split, prompt_tokens, press, retention, budget)
    coords["step"] = ("step", np.arange(1, horizon + 1, dtype=np.int32))
    return xr.Dataset(data, coords=coords, attrs=_attrs(
        "coupled", horizon, vocab_size, horizon, eos_token_id, model, sampling, producer, attrs, eos_token_ids))


def residual_dataset(
    shared_tv: Any,
    shared_token: Any,
    branch_step: Any,
    branch_tv: Any,
    branch_x_token: Any,
    branch_y_token: Any,
    *,
    vocab_size: int,
    window: int | None = None,
    docs: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
    eos_token_id: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    model: str = "",
    sampling: Mapping[str, Any] | str | None = None,
    producer: str | None = None,
    split: Sequence[str] | None = None,
    prompt_tokens: Sequence[int] | None = None,
    press: Sequence[str] | None = None,
    retention: Sequence[float] | None = None,
    budget: Sequence[int] | None = None,
    attrs: Mapping[str, Any] | None = None,
) -> xr.Dataset:
    """Build a ``residual`` trace dataset (docs/statistics.md §5, docs/contract.md §1).

    Parameters
    ----------
    shared_tv, shared_token : array_like
        The survival path: TV (NaN after the path stopped) and token Z_t (-1
        where none), shaped (doc, policy, replicate, step) or (replicate, step).
    branch_step : array_like
        The branch point t* per (doc, policy, replicate) (or per replicate);
        0 when divergence is impossible.
    branch_tv, branch_x_token, branch_y_token : array_like
        The two branches at ages 0..T-1, shaped like ``shared_tv`` with ``age``
        for ``step``; NaN / -1 where unobserved.
    window : int, optional
        The observation window W after t*; defaults to the horizon (branches
        run to the end).
    vocab_size : int
        Size of the models' vocabulary (attr ``vocab_size``).
    docs, policies : sequence of str, optional
        Ids along ``doc`` and ``policy`` (default ``doc0, doc1, ...`` and
        ``candidate``); each policy id also gives the ``press``, ``retention`` and
        ``budget`` coordinates through :func:`protocols.policies.policy_coords`.
    eos_token_id : int, optional
        The EOS token, or None (stored as -1) when EOS is not absorbing.
    eos_token_ids : sequence of int, optional
        Every EOS id when the model has several (each absorbing: a side that
        emits one keeps emitting it); stored as attr ``eos_token_ids`` when
        there are more than one, with ``eos_token_id`` = the first.
    model, producer : str, optional
        Attrs naming the model and the program that produced the traces.
    sampling : mapping or JSON str, optional
        Sampling parameters, stored as a JSON object (default temperature 1,
        no top-k / top-p).
    split, prompt_tokens : sequence, optional
        Per-doc coordinates (default ``""`` and 0).
    press, retention, budget : sequence, optional
        Per-policy coordinates overriding the ones parsed from the policy ids.
    attrs : mapping, optional
        Extra attributes, added after (and able to override) the contract's.

    Returns
    -------
    xarray.Dataset
        The dataset (not validated).

    Raises
    ------
    ValueError
        An array of the wrong rank or shape, or id lists of the wrong length.

    Examples
    --------
    >>> import numpy as np
    >>> ds = residual_dataset([[0.5, np.nan]], [[-1, -1]], [1], [[0.5, np.nan]], [[1, -1]], [[2, -1]],
    ...                       vocab_size=4, window=0)
    >>> int(ds.branch_step.item()), ds.attrs["window"]
    (1, 0)
    """
    stv = _as4("shared_tv", shared_tv, PROB_DTYPE)
    stok = _as4("shared_token", shared_token, TOKEN_DTYPE)
    n_doc, n_pol, n_rep, horizon = stv.shape
    bstep = np.asarray(branch_step)
    if bstep.ndim == 1:
        bstep = bstep[None, None]
    bstep = bstep.astype(TOKEN_DTYPE, copy=False)
    if bstep.shape != (n_doc, n_pol, n_rep):
        raise ValueError(f"branch_step: expected shape {(n_doc, n_pol, n_rep)}, got {bstep.shape}")
    btv = _as4("branch_tv", branch_tv, PROB_DTYPE)
    bx = _as4("branch_x_token", branch_x_token, TOKEN_DTYPE)
    by = _as4("branch_y_token", branch_y_token, TOKEN_DTYPE)
    sdims = REQUIRED_VARS["residual"]["shared_tv"]
    adims = REQUIRED_VARS["residual"]["branch_tv"]
    data = {
        "shared_tv": _var(sdims, stv, "shared_tv"),
        "shared_token": _var(sdims, stok, "shared_token"),
        "branch_step": _var(REQUIRED_VARS["residual"]["branch_step"], bstep, "branch_step"),
        "branch_tv": _var(adims, btv, "branch_tv"),
        "branch_x_token": _var(adims, bx, "branch_x_token"),
        "branch_y_token": _var(adims, by, "branch_y_token"),
    }
    coords = _coords(n_doc, n_pol, n_rep, docs, policies, split, prompt_tokens, press, retention, budget)
    coords["step"] = ("step", np.arange(1, horizon + 1, dtype=np.int32))
    coords["age"] = ("age", np.arange(btv.shape[-1], dtype=np.int32))
    window = horizon if window is None else int(window)
    return xr.Dataset(data, coords=coords, attrs=_attrs(
        "residual", horizon, vocab_size, window, eos_token_id, model, sampling, producer, attrs, eos_token_ids))


def reference_dataset(
    x_token: Any,
    x_logp: Any,
    x_logq: Any,
    *,
    vocab_size: int,
    docs: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
    eos_token_id: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    model: str = "",
    sampling: Mapping[str, Any] | str | None = None,
    producer: str | None = None,
    split: Sequence[str] | None = None,
    prompt_tokens: Sequence[int] | None = None,
    press: Sequence[str] | None = None,
    retention: Sequence[float] | None = None,
    budget: Sequence[int] | None = None,
    attrs: Mapping[str, Any] | None = None,
) -> xr.Dataset:
    """Build a ``reference`` dataset: tokens sampled from P with log p and log q of each.

    The window attribute is 0: nothing after divergence is observed (docs/statistics.md §7).

    Parameters
    ----------
    x_token, x_logp, x_logq : array_like
        Tokens sampled from P, log p_t(x_t) and log q_t(x_t), shaped
        (doc, policy, replicate, step) or (replicate, step).
    vocab_size : int
        Size of the models' vocabulary (attr ``vocab_size``).
    docs, policies : sequence of str, optional
        Ids along ``doc`` and ``policy`` (default ``doc0, doc1, ...`` and
        ``candidate``); each policy id also gives the ``press``, ``retention`` and
        ``budget`` coordinates through :func:`protocols.policies.policy_coords`.
    eos_token_id : int, optional
        The EOS token, or None (stored as -1) when EOS is not absorbing.
    eos_token_ids : sequence of int, optional
        Every EOS id when the model has several (each absorbing: a side that
        emits one keeps emitting it); stored as attr ``eos_token_ids`` when
        there are more than one, with ``eos_token_id`` = the first.
    model, producer : str, optional
        Attrs naming the model and the program that produced the traces.
    sampling : mapping or JSON str, optional
        Sampling parameters, stored as a JSON object (default temperature 1,
        no top-k / top-p).
    split, prompt_tokens : sequence, optional
        Per-doc coordinates (default ``""`` and 0).
    press, retention, budget : sequence, optional
        Per-policy coordinates overriding the ones parsed from the policy ids.
    attrs : mapping, optional
        Extra attributes, added after (and able to override) the contract's.

    Returns
    -------
    xarray.Dataset
        The dataset (not validated).

    Raises
    ------
    ValueError
        An array of the wrong rank, or id lists of the wrong length.

    Examples
    --------
    >>> ds = reference_dataset([[1, 2]], [[-0.5, -1.0]], [[-0.7, -2.0]], vocab_size=4)
    >>> ds.attrs["kind"], ds.attrs["window"]
    ('reference', 0)
    """
    xt = _as4("x_token", x_token, TOKEN_DTYPE)
    lp = _as4("x_logp", x_logp, PROB_DTYPE)
    lq = _as4("x_logq", x_logq, PROB_DTYPE)
    n_doc, n_pol, n_rep, horizon = xt.shape
    dims = REQUIRED_VARS["reference"]["x_token"]
    data = {"x_token": _var(dims, xt, "x_token"), "x_logp": _var(dims, lp, "x_logp"),
            "x_logq": _var(dims, lq, "x_logq")}
    coords = _coords(n_doc, n_pol, n_rep, docs, policies, split, prompt_tokens, press, retention, budget)
    coords["step"] = ("step", np.arange(1, horizon + 1, dtype=np.int32))
    return xr.Dataset(data, coords=coords, attrs=_attrs(
        "reference", horizon, vocab_size, 0, eos_token_id, model, sampling, producer, attrs, eos_token_ids))


_to_str = np.frompyfunc(str, 1, 1)


def answer_variables(
    n_doc: int,
    n_pol: int,
    n_rep: int,
    *,
    x_score: Any = None,
    y_score: Any = None,
    x_text: Any = None,
    y_text: Any = None,
    x_answer_start: Any = None,
    answers: Sequence[Sequence[str] | str] | None = None,
    scorer: Sequence[str] | str | None = None,
    task: Sequence[str] | str | None = None,
    needle_depth: Sequence[float] | None = None,
) -> dict[str, xr.Variable]:
    """The answer variables (docs/contract.md "Answers") in their contract dtypes, for the given ones.

    Parameters
    ----------
    n_doc, n_pol, n_rep : int
        The dataset's sizes, which the arrays must match.
    x_score, y_score : array_like, optional
        Scores in [0, 1] (NaN: not scored), shaped (doc, policy, replicate); float64.
    x_text, y_text : array_like of str, optional
        P's and Q's decoded answers, shaped (doc, policy, replicate).
    x_answer_start : array_like of int, optional
        The step index where P's scored answer starts (-1: not located); int32.
    answers : sequence, optional
        Per document, the acceptable answers: a list of strings (stored JSON-encoded)
        or its JSON text already.
    scorer, task : str or sequence of str, optional
        Per document (a single string is used for every document).
    needle_depth : sequence of float, optional
        Per document, in [0, 1] (NaN where the task has no needle).

    Returns
    -------
    dict of str to xarray.Variable
        Only the variables given; assign them to a dataset (``ds.assign(...)``).

    Raises
    ------
    ValueError
        An array of the wrong shape.

    Examples
    --------
    >>> v = answer_variables(1, 1, 2, x_score=[[[1.0, 0.0]]], answers=[["4711"]], scorer="ruler_all")
    >>> v["answers"].values.tolist(), str(v["x_score"].dtype)
    (['["4711"]'], 'float64')
    """
    out: dict[str, xr.Variable] = {}
    cube = (n_doc, n_pol, n_rep)

    def put(name: str, value: Any, dtype: Any, shape: tuple[int, ...]) -> None:
        if value is None:
            return
        if dtype is object:
            if isinstance(value, str):   # one label for every document
                value = [value] * n_doc
            arr = np.asarray(value, dtype=object)
            arr = _to_str(arr) if arr.size else arr
        else:
            arr = np.asarray(value, dtype=dtype)
        if arr.shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {arr.shape}")
        out[name] = _var(ANSWER_VARS[name], arr, name)

    for name in ("x_score", "y_score"):
        put(name, locals()[name], SCORE_DTYPE, cube)
    for name in ("x_text", "y_text"):
        put(name, locals()[name], object, cube)
    put("x_answer_start", x_answer_start, TOKEN_DTYPE, cube)
    if answers is not None:
        put("answers", [a if isinstance(a, str) else json.dumps([str(x) for x in a], ensure_ascii=False)
                        for a in answers], object, (n_doc,))
    put("scorer", scorer, object, (n_doc,))
    put("task", task, object, (n_doc,))
    put("needle_depth", needle_depth, SCORE_DTYPE, (n_doc,))
    return out


def answers_dataset(
    x_score: Any,
    y_score: Any,
    *,
    docs: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
    model: str = "",
    producer: str | None = None,
    sampling: Mapping[str, Any] | str | None = None,
    split: Sequence[str] | None = None,
    prompt_tokens: Sequence[int] | None = None,
    press: Sequence[str] | None = None,
    retention: Sequence[float] | None = None,
    budget: Sequence[int] | None = None,
    attrs: Mapping[str, Any] | None = None,
    **answer_vars: Any,
) -> xr.Dataset:
    """Build an ``answers`` dataset: P's and Q's task scores without tokens (docs/contract.md "Answers").

    For scores from elsewhere (a leaderboard's predictions): no horizon, vocabulary,
    window, EOS or coupling. P is the reference (full-cache) run, Q the policy's.

    Parameters
    ----------
    x_score, y_score : array_like
        Scores in [0, 1] (NaN: not scored), shaped (doc, policy, replicate) or
        (doc, policy) for one replicate.
    docs, policies : sequence of str, optional
        Ids along ``doc`` and ``policy``; each policy id also gives the ``press``,
        ``retention`` and ``budget`` coordinates (:func:`protocols.policies.policy_coords`).
    model, producer : str, optional
        Attrs naming the model and the program that produced the scores.
    sampling : mapping or JSON str, optional
        The decoding's parameters when known (attr ``sampling``; absent when None).
    split, prompt_tokens, press, retention, budget : sequence, optional
        As for :func:`coupled_dataset`.
    attrs : mapping, optional
        Extra attributes.
    **answer_vars
        The optional answer variables of :func:`answer_variables` (``x_text``,
        ``y_text``, ``answers``, ``scorer``, ``task``, ``needle_depth``).

    Returns
    -------
    xarray.Dataset
        The dataset (not validated).

    Raises
    ------
    ValueError
        Arrays of the wrong rank or shape, or id lists of the wrong length.

    Examples
    --------
    >>> ds = answers_dataset([[1.0, 0.0]], [[1.0, 1.0]], policies=["snapkv@0.5", "recent@0.5"],
    ...                      answers=[["4711"]], scorer="ruler_all", model="m")
    >>> dict(ds.sizes), ds.attrs["kind"]
    ({'doc': 1, 'policy': 2, 'replicate': 1}, 'answers')
    """
    xs, ys = (np.asarray(a, dtype=SCORE_DTYPE) for a in (x_score, y_score))
    xs, ys = (a[..., None] if a.ndim == 2 else a for a in (xs, ys))
    if xs.ndim != 3 or xs.shape != ys.shape:
        raise ValueError(f"x_score, y_score: expected two arrays shaped (doc, policy, replicate), "
                         f"got {xs.shape} and {ys.shape}")
    n_doc, n_pol, n_rep = xs.shape
    data = answer_variables(n_doc, n_pol, n_rep, x_score=xs, y_score=ys, **answer_vars)
    coords = _coords(n_doc, n_pol, n_rep, docs, policies, split, prompt_tokens, press, retention, budget)
    a: dict[str, Any] = {"schema": SCHEMA, "kind": "answers", "model": str(model), "producer": producer or _producer()}
    if sampling is not None:
        a["sampling"] = _sampling_json(sampling)
    a.update(attrs or {})
    return xr.Dataset(data, coords=coords, attrs=a)


def sampling_params(ds: xr.Dataset) -> dict[str, Any]:
    """The dataset's sampling parameters as a dict.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset; its ``sampling`` attr holds a JSON object.

    Returns
    -------
    dict
        The decoded object; ``{}`` when the attr is missing or empty.

    Raises
    ------
    json.JSONDecodeError
        The attr is not JSON (:func:`protocols.validate.validate` reports that too).

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> sampling_params(example_dataset(docs=1, policies=1))
    {'temperature': 1.0, 'top_k': 0, 'top_p': 1.0}
    """
    return json.loads(ds.attrs.get("sampling", "{}") or "{}")

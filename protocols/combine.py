"""Concatenate trace datasets along ``doc``, ``policy`` or a new ``model`` dim.

The inputs must agree on everything that makes their numbers comparable:
kind, horizon, window, coupling, sampling, replicate count and (except across
models) vocab_size, eos_token_id and model. Ids along the combined dim must be
new; the other dims must hold the same ids (order may differ: later inputs
are aligned to the first) with the same per-doc / per-policy coordinates.

Coordinates that live on the combined dim (e.g. ``split`` when combining docs,
``press`` when combining policies, ``retained_tokens`` on (doc, policy)) are
concatenated. Attributes other than the checked ones are kept when all inputs
agree and dropped otherwise; ``producer`` lists every distinct producer.

Across models (``dim="model"``) a ``model`` dimension is prepended, with the
models' names as its coordinate (from ``models=`` or each input's ``model``
attr) and per-model coordinates ``vocab_size`` and ``eos_token_id``, plus
``eos_token_ids`` on (model, eos) (each model's EOS set, padded with -1) when a
model has several EOS ids; the global attrs then hold the largest vocab_size,
the common eos_token_id (-1 if they differ), the common ``eos_token_ids`` (only
when every model has the same set) and the model names joined by ``", "``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from protocols.errors import ProtocolError
from protocols.schema import PER_MODEL_COORDS, eos_ids
from protocols.validate import validate as _validate

__all__ = ["DIMS", "CombineError", "combine"]

_SAME = ("schema", "kind", "horizon", "window", "coupling", "sampling")
_SAME_UNLESS_MODEL = ("vocab_size", "eos_token_id", "model")
DIMS = ("doc", "policy", "model")


class CombineError(ProtocolError, ValueError):
    """Datasets that cannot be combined, with the reason."""


def _labels(ds: xr.Dataset, dim: str) -> list[str]:
    return [str(v) for v in ds.coords[dim].values]


def _check_attrs(datasets: Sequence[xr.Dataset], dim: str) -> None:
    keys = _SAME + (() if dim == "model" else _SAME_UNLESS_MODEL)
    first = datasets[0].attrs
    for i, ds in enumerate(datasets[1:], start=1):
        for key in keys:
            if ds.attrs.get(key) != first.get(key):
                raise CombineError(f"dataset {i}: attribute {key!r} = {ds.attrs.get(key)!r} differs from "
                                   f"dataset 0's {first.get(key)!r}; only comparable traces can be combined")
        if dim != "model" and eos_ids(ds.attrs) != eos_ids(first):
            raise CombineError(f"dataset {i}: EOS ids {list(eos_ids(ds.attrs))} differ from dataset 0's "
                               f"{list(eos_ids(first))}; only comparable traces can be combined")
        if ds.sizes.get("replicate") != datasets[0].sizes.get("replicate"):
            raise CombineError(f"dataset {i}: {ds.sizes.get('replicate')} replicates, dataset 0 has "
                               f"{datasets[0].sizes.get('replicate')}")
        if "model" in ds.dims:
            raise CombineError(f"dataset {i} already has a 'model' dim; combine per model first")
        if ds.sizes.get("top") != datasets[0].sizes.get("top"):   # logit traces of another k (or none)
            raise CombineError(f"dataset {i}: logit traces with top_logprobs {ds.sizes.get('top', 0)}, dataset 0 "
                               f"has {datasets[0].sizes.get('top', 0)}; collect them with the same --top-logprobs")


def _align_others(datasets: list[xr.Dataset], dim: str) -> list[xr.Dataset]:
    """The dims not being combined must hold the same ids and per-id coords in every input
    (except :data:`PER_MODEL_COORDS` when combining along ``model``)."""
    others = [d for d in ("doc", "policy") if d != dim]
    out = [datasets[0]]
    for i, ds in enumerate(datasets[1:], start=1):
        for other in others:
            want, have = _labels(datasets[0], other), _labels(ds, other)
            if sorted(want) != sorted(have):
                missing = sorted(set(want) - set(have))
                extra = sorted(set(have) - set(want))
                raise CombineError(f"dataset {i}: {other} ids differ from dataset 0 (missing {missing}, "
                                   f"extra {extra}); every input needs the same {other}s")
            ds = ds.sel({other: datasets[0].coords[other].values})
            for name, coord in datasets[0].coords.items():
                if coord.dims == (other,) and name != other:
                    if dim == "model" and name in PER_MODEL_COORDS and name in ds.coords:
                        continue
                    if name not in ds.coords or not coord.variable.equals(ds.coords[name].variable):
                        raise CombineError(f"dataset {i}: per-{other} coordinate {name!r} differs from dataset 0")
        out.append(ds)
    return out


def _check_same_variables(datasets: Sequence[xr.Dataset]) -> None:
    """Every input must carry the same variables and coordinates (nothing gets NaN-padded)."""
    first = set(datasets[0].variables)
    for i, ds in enumerate(datasets[1:], start=1):
        names = set(ds.variables)
        if names != first:
            raise CombineError(f"dataset {i}: variables/coordinates differ from dataset 0 "
                               f"(missing {sorted(first - names)}, extra {sorted(names - first)})")


def _check_new_ids(datasets: Sequence[xr.Dataset], dim: str) -> None:
    seen: dict[str, int] = {}
    for i, ds in enumerate(datasets):
        for label in _labels(ds, dim):
            if label in seen:
                raise CombineError(f"duplicate {dim} id {label!r} in datasets {seen[label]} and {i}")
            seen[label] = i


def _merged_attrs(datasets: Sequence[xr.Dataset]) -> dict:
    attrs = {}
    for key, value in datasets[0].attrs.items():
        if all(key in ds.attrs and _eq(ds.attrs[key], value) for ds in datasets[1:]):
            attrs[key] = value
    producers = list(dict.fromkeys(str(ds.attrs.get("producer", "")) for ds in datasets))
    attrs["producer"] = "; ".join(producers)
    return attrs


def _eq(a, b) -> bool:
    try:
        return bool(np.all(a == b))
    except (TypeError, ValueError):
        return False


def _by_model(datasets: list[xr.Dataset], models: Sequence[str] | None) -> xr.Dataset:
    names = [str(m) for m in models] if models is not None else [str(ds.attrs.get("model", "")) for ds in datasets]
    if len(names) != len(datasets):
        raise CombineError(f"models: {len(names)} names for {len(datasets)} datasets")
    if len(set(names)) != len(names) or not all(names):
        raise CombineError(f"model names must be distinct and non-empty, got {names}; pass models=[...]")
    vocab = [int(ds.attrs["vocab_size"]) for ds in datasets]
    eos = [int(ds.attrs["eos_token_id"]) for ds in datasets]
    # a per-model coordinate that differs between the inputs is kept per model, (model, doc)
    differ = [name for name in PER_MODEL_COORDS if name in datasets[0].coords
              and not all(datasets[0].coords[name].variable.equals(ds.coords[name].variable) for ds in datasets[1:])]
    out = xr.concat(datasets, dim="model", data_vars="all", coords=differ or "minimal", compat="override",
                    join="exact", combine_attrs="drop_conflicts")
    out = out.assign_coords(model=("model", np.array(names, dtype=object)),
                            vocab_size=("model", np.array(vocab, dtype=np.int32)),
                            eos_token_id=("model", np.array(eos, dtype=np.int32)))
    sets = [eos_ids(ds.attrs) for ds in datasets]
    if max(len(e) for e in sets) > 1:  # each model's EOS set, padded with -1
        table = np.full((len(sets), max(len(e) for e in sets)), -1, dtype=np.int32)
        for i, e in enumerate(sets):
            table[i, :len(e)] = e
        out = out.assign_coords(eos_token_ids=(("model", "eos"), table))
    attrs = _merged_attrs(datasets)
    attrs.update(vocab_size=max(vocab), eos_token_id=eos[0] if len(set(eos)) == 1 else -1, model=", ".join(names))
    out.attrs = {k: attrs[k] for k in list(datasets[0].attrs) if k in attrs}
    return out


def combine(
    datasets: Sequence[xr.Dataset],
    dim: str = "doc",
    *,
    models: Sequence[str] | None = None,
    validate: bool = True,
) -> xr.Dataset:
    """Concatenate trace datasets along ``dim`` ("doc", "policy" or "model").

    Parameters
    ----------
    datasets : sequence of xarray.Dataset
        Comparable trace datasets (module docstring: same kind, horizon, window,
        coupling, sampling and replicate count; the same ids on the other dims).
    dim : {"doc", "policy", "model"}
        The dim to concatenate along; ``"model"`` prepends a new dim.
    models : sequence of str, optional
        Names along ``model`` (default: each input's ``model`` attr).
    validate : bool, default True
        Validate the result; ``False`` for intermediate steps of a large
        combination whose final result is validated anyway.

    Returns
    -------
    xarray.Dataset
        The combined dataset.

    Raises
    ------
    CombineError
        Inputs that are not comparable, repeated ids, or nothing to combine.
    ValueError
        ``dim`` is not one of ``DIMS``.
    TraceValidationError
        The result breaks the contract (only with ``validate=True``).

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> a = example_dataset(docs=["a"], seed=1)
    >>> b = example_dataset(docs=["b"], seed=2)
    >>> [str(d) for d in combine([a, b], "doc").doc.values]
    ['a', 'b']
    """
    datasets = list(datasets)
    if dim not in DIMS:
        raise ValueError(f"dim must be one of {DIMS}, got {dim!r}")
    if not datasets:
        raise CombineError("nothing to combine")
    _check_attrs(datasets, dim)
    datasets = _align_others(datasets, dim)
    _check_same_variables(datasets)
    if dim == "model":
        out = _by_model(datasets, models)
    else:
        _check_new_ids(datasets, dim)
        # Coords without `dim` (e.g. per-policy ones when combining docs) come from
        # the first input; _align_others has checked they are equal everywhere.
        out = xr.concat(datasets, dim=dim, data_vars="minimal", coords="minimal", compat="override",
                        join="exact", combine_attrs="drop_conflicts")
        out.attrs = _merged_attrs(datasets)
    return _validate(out, source=f"(combined along {dim})") if validate else out

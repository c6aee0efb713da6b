"""Which constructor parameters of a press a request may set, and their checks.

A request may set numbers, booleans and enumerated strings, each checked for type
(a boolean is not an integer, 1.5 is not an integer, NaN is not a number) and range.
Anything that names a file, folder, dataset, hub repository or module is a
*server-side* option (``kvdiv serve --press-option Class:key=value``), never a
request field. The spec of each parameter comes from the press's type hints, with
ranges declared here by parameter name.
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from dataclasses import dataclass
from typing import Any

from gen_service.errors import PolicyError
from gen_service.presses.table import PRESSES

__all__ = ["ATTRIBUTE_PARAMS", "ParamSpec", "param_specs", "press_slots", "check_value", "SERVER_SIDE"]


# Parameters that name files, folders, datasets, hub repositories or models: only
# the server's operator may set them.
SERVER_SIDE = frozenset({"stats_folder", "dataset_name", "model_name", "model_type", "kvzap_model_name",
                         "sample_seq_len", "num_samples", "on_the_fly_scoring"})

# (low, high, low_inclusive, high_inclusive) by parameter name; ints default to >= 0.
_FRACTION = (0.0, 1.0, True, False)
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "compression_ratio": _FRACTION, "key_channel_compression_ratio": _FRACTION,
    "head_compression_ratio": _FRACTION, "target_compression_ratio": _FRACTION,
    "first_stage_ratio": (0.0, 1.0, True, True), "alpha_safeguard": (0.0, 1.0, True, True),
    "merge_fraction": (0.0, 1.0, True, True), "window_ratio": (0.0, 1.0, False, True),
    "similarity_threshold": (-1.0, 1.0, True, True), "epsilon": (0.0, math.inf, True, False),
    "tau": (0.0, math.inf, False, False), "lazy_threshold": (0.0, math.inf, True, False),
    "threshold": (-math.inf, math.inf, False, False), "beta": (1, math.inf, True, False),
}
# Integer parameters that must be >= 1 (sizes, lengths, intervals, windows).
_POSITIVE = ("size", "length", "interval", "window", "n_last", "n_recent", "dimension", "budget",
             "n_future_positions", "lag")


@dataclass(frozen=True)
class ParamSpec:
    """One request-settable parameter: its kind and allowed values."""

    name: str
    kind: str                                  # "int", "float", "bool", "choice", "floats"
    choices: tuple[str, ...] = ()
    optional: bool = False                     # None is the press's default


def _is_press_type(tp: Any) -> bool:
    from kvpress import BasePress

    args = typing.get_args(tp)
    if args:
        return any(_is_press_type(a) for a in args if a is not type(None))
    return isinstance(tp, type) and issubclass(tp, BasePress)


def _kind(tp: Any) -> tuple[str, tuple[str, ...], bool] | None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or (origin is not None and type(None) in args):
        inner = [a for a in args if a is not type(None)]
        found = _kind(inner[0]) if len(inner) == 1 else None
        return None if found is None else (found[0], found[1], True)
    if origin is typing.Literal:
        return "choice", tuple(str(a) for a in args), False
    if origin in (list, typing.List) and args and args[0] is float:  # noqa: UP006
        return "floats", (), False
    return {bool: ("bool", (), False), int: ("int", (), False), float: ("float", (), False)}.get(tp)


# Plain-str parameters that are really enumerations (kvpress types them as str).
_STR_CHOICES = {"agg_task": ("max", "mean"), "agg_group": ("max", "mean"), "agg_head": ("max", "mean"),
                "blending": ("none",)}


@functools.cache
def _hints(cls: type) -> tuple[list[inspect.Parameter], dict[str, Any]]:
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an unresolvable annotation: fall back to none
        hints = {}
    return params, hints


@functools.cache
def press_slots(cls: type) -> tuple[tuple[str, bool, bool], ...]:
    """Constructor parameters holding inner presses: (name, is_list, required), in order."""
    params, hints = _hints(cls)
    out = []
    for p in params:
        tp = hints.get(p.name)
        if tp is None:
            continue
        is_list = typing.get_origin(tp) in (list, typing.List) and _is_press_type(typing.get_args(tp)[0])  # noqa: UP006
        if is_list or _is_press_type(tp):
            out.append((p.name, is_list, p.default is inspect.Parameter.empty))
    return tuple(out)


@functools.cache
def param_specs(cls: type) -> dict[str, ParamSpec]:
    """The parameters of ``cls`` a request may set (not inner presses, not server-side ones)."""
    params, hints = _hints(cls)
    slots = {name for name, _, _ in press_slots(cls)}
    out = {}
    for p in params:
        if p.name in slots or p.name.startswith("_") or p.name in SERVER_SIDE:
            continue
        kind = _kind(hints.get(p.name))
        if kind is None and hints.get(p.name) is str and p.name in _STR_CHOICES:
            kind = ("choice", _STR_CHOICES[p.name], False)
        if kind is not None:
            out[p.name] = ParamSpec(p.name, kind[0], kind[1], kind[2])
    out.update(ATTRIBUTE_PARAMS.get(cls.__name__, {}))
    return out


# Settings a press takes as attributes after construction (not constructor arguments):
# the press table's ``attributes``, each of the kind of its default.
_KIND_OF = {bool: "bool", int: "int", float: "float"}
ATTRIBUTE_PARAMS: dict[str, dict[str, ParamSpec]] = {
    p.name: {k: ParamSpec(k, _KIND_OF[type(v)]) for k, v in p.attributes.items()} for p in PRESSES if p.attributes
}


def _in_range(name: str, value: float, where: str) -> None:
    lo, hi, lo_in, hi_in = _RANGES.get(name, (-math.inf, math.inf, False, False))
    if name not in _RANGES and isinstance(value, int):
        lo, lo_in = (1, True) if any(s in name for s in _POSITIVE) else (0, True)
    ok_lo = value >= lo if lo_in else value > lo
    ok_hi = value <= hi if hi_in else value < hi
    if not (ok_lo and ok_hi):
        lo_b, hi_b = "[" if lo_in else "(", "]" if hi_in else ")"
        raise PolicyError(f"{where}: {name}={value} is outside {lo_b}{lo}, {hi}{hi_b}", name)


def check_value(spec: ParamSpec, value: object, where: str, max_int: int) -> object:
    """The checked value for one parameter, or :class:`PolicyError` naming it."""
    name = spec.name
    if spec.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyError(f"{where}: {name} must be an integer, not {value!r}", name)
        if abs(value) > max_int:
            raise PolicyError(f"{where}: {name}={value} exceeds the model's context ({max_int})", name)
        _in_range(name, value, where)
        return value
    if spec.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PolicyError(f"{where}: {name} must be a finite number, not {value!r}", name)
        _in_range(name, float(value), where)
        return float(value)
    if spec.kind == "choice":
        if str(value) not in spec.choices:
            raise PolicyError(f"{where}: {name} must be one of {', '.join(spec.choices)}, not {value!r}", name)
        return None if spec.choices == ("none",) else str(value)
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise PolicyError(f"{where}: {name} must be true or false, not {value!r}", name)
        return value
    return _floats(name, value, where)


def _floats(name: str, value: object, where: str) -> list[float]:
    """A ';'-separated list of ratios (PerLayerCompressionPress's compression_ratios)."""
    items = [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value).split(";")
    try:
        floats = [float(v) for v in items]
    except ValueError:
        raise PolicyError(f"{where}: {name} must be numbers separated by ';', not {value!r}", name) from None
    for v in floats:
        if not math.isfinite(v):
            raise PolicyError(f"{where}: {name} must be finite numbers, not {value!r}", name)
        _in_range("compression_ratio", v, f"{where}: {name}")
    return floats

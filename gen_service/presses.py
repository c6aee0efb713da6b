"""Policy registry: policy ids (``protocols.parse_policy_id``) -> kvpress presses.

One small class per policy behind one interface, :class:`Policy`: given the prompt
length it builds the kvpress press to use during prefill (or ``None`` for no
eviction) and says how many prompt tokens it is expected to keep. Compression
happens during prefill, as kvpress does it: each attention layer attends to the
whole prompt and its cache is compressed right after, so the first new token's
distribution is exactly the full model's (step-1 TV = 0) and eviction acts from
step 2 on.

Built-in names: ``full``, ``snapkv``, ``recent``, ``streaming``, ``kvpress:<Class>``.
More come from the entry point group ``kvdiv.presses`` (name -> press class) or
``--press module:Class`` at server start (never from a request).
"""

from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass, field, fields, is_dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar

from gen_service.errors import ServiceError
from protocols import PolicyIdError, PolicySpec, parse_policy_id

log = logging.getLogger("kvdiv.service")

ENTRY_POINT_GROUP = "kvdiv.presses"


class PolicyError(ServiceError, ValueError):
    """A policy id the server cannot serve (unknown name, bad parameter...)."""


@dataclass
class Plan:
    """What a policy will do to one prompt."""

    press: Any | None          # a kvpress press, or None: keep the whole prompt
    expected_kept: int         # prompt tokens expected to stay in the cache
    note: str = ""             # e.g. "prompt shorter than budget: kept whole"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Policy:
    """Base policy: a parsed id plus a press factory. Subclasses set ``press_name``."""

    spec: PolicySpec
    press_name: ClassVar[str] = "none"

    def compression_ratio(self, prompt_len: int) -> tuple[float, str]:
        """kvpress's compression_ratio (fraction removed) = 1 - retention, or the
        ratio that keeps ``budget`` tokens of this prompt."""
        if self.spec.budget >= 1:
            if prompt_len <= self.spec.budget:
                return 0.0, f"prompt of {prompt_len} tokens is within the budget {self.spec.budget}: kept whole"
            return 1.0 - self.spec.budget / prompt_len, ""
        return 1.0 - self.spec.retention, ""

    def make_press(self, ratio: float, prompt_len: int) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError

    def plan(self, prompt_len: int) -> Plan:
        ratio, note = self.compression_ratio(prompt_len)
        if ratio <= 0.0 or prompt_len < 2:
            return Plan(None, prompt_len, note or ("nothing to evict" if ratio > 0 else ""))
        press, params = self.make_press(ratio, prompt_len)
        if self.spec.budget >= 1:
            # floating point can make int(L * (1 - ratio)) one short of the budget
            ratio = 1.0 - (self.spec.budget + 0.5) / prompt_len
            press.compression_ratio = ratio
        kept = expected_kept(prompt_len, ratio)
        params = {"compression_ratio": ratio, **params}
        return Plan(press, kept, note, params)

    def describe(self) -> dict[str, Any]:
        return {"policy": self.spec.id, "press": self.press_name,
                "retention": None if math.isnan(self.spec.retention) else self.spec.retention,
                "budget": self.spec.budget}


def expected_kept(prompt_len: int, ratio: float) -> int:
    from kvpress.utils import compute_n_kept

    return compute_n_kept(prompt_len, ratio)


def _set_params(press: Any, params: dict[str, Any], policy_id: str) -> dict[str, Any]:
    """Apply ``:k=v`` parameters to a press, refusing names the press does not have."""
    known = {f.name for f in fields(press)} if is_dataclass(press) else set(vars(press))
    for key, value in params.items():
        if key == "compression_ratio":
            raise PolicyError(f"policy {policy_id!r}: set the ratio with @<retention>, not compression_ratio")
        if key not in known:
            raise PolicyError(f"policy {policy_id!r}: press {type(press).__name__} has no parameter {key!r}")
        setattr(press, key, value)
    return dict(params)


@dataclass
class FullPolicy(Policy):
    """No eviction: the reference kernel P."""

    press_name: ClassVar[str] = "none"

    def plan(self, prompt_len: int) -> Plan:
        return Plan(None, prompt_len)


@dataclass
class SnapKVPolicy(Policy):
    """SnapKV: keep the prompt tokens the last ``window_size`` queries attend to most."""

    press_name: ClassVar[str] = "SnapKVPress"

    def make_press(self, ratio: float, prompt_len: int) -> tuple[Any, dict[str, Any]]:
        from kvpress import SnapKVPress

        press = SnapKVPress(compression_ratio=ratio)
        params = _set_params(press, self.spec.params, self.spec.id)
        # kvpress asserts prompt_len > window_size; short prompts use every token but
        # the last as observation window (the header reports the effective value).
        if press.window_size >= prompt_len:
            press.window_size = prompt_len - 1
            params["window_size"] = press.window_size
        return press, params


@dataclass
class RecentPolicy(Policy):
    """Keep the most recent tokens only (StreamingLLM without sink tokens)."""

    press_name: ClassVar[str] = "StreamingLLMPress"
    n_sink: ClassVar[int] = 0

    def make_press(self, ratio: float, prompt_len: int) -> tuple[Any, dict[str, Any]]:
        from kvpress import StreamingLLMPress

        press = StreamingLLMPress(compression_ratio=ratio, n_sink=self.n_sink)
        params = {"n_sink": self.n_sink, **_set_params(press, self.spec.params, self.spec.id)}
        press.n_sink = min(press.n_sink, prompt_len - 1)  # kvpress asserts k_len > n_sink
        return press, params


@dataclass
class StreamingPolicy(RecentPolicy):
    """StreamingLLM: 4 attention-sink tokens plus the most recent tokens."""

    n_sink: ClassVar[int] = 4


@dataclass
class PressClassPolicy(Policy):
    """Any press class taking ``compression_ratio`` (kvpress by name, entry points, --press)."""

    press_cls: Any = None

    @property
    def press_name(self) -> str:  # type: ignore[override]
        return self.press_cls.__name__

    def make_press(self, ratio: float, prompt_len: int) -> tuple[Any, dict[str, Any]]:
        try:
            press = self.press_cls(compression_ratio=ratio)
        except TypeError as exc:
            raise PolicyError(f"policy {self.spec.id!r}: {self.press_cls.__name__} cannot be built "
                              f"from a compression_ratio ({exc})") from None
        return press, _set_params(press, self.spec.params, self.spec.id)


BUILTIN: dict[str, type[Policy]] = {
    "full": FullPolicy,
    "snapkv": SnapKVPolicy,
    "recent": RecentPolicy,
    "streaming": StreamingPolicy,
}


def load_class(target: str) -> type:
    """``module:Class`` -> the class (for ``--press``)."""
    module_name, _, attr = target.partition(":")
    if not attr:
        raise PolicyError(f"--press {target!r}: expected module:Class")
    return getattr(importlib.import_module(module_name), attr)


class PolicyRegistry:
    """Maps policy names to policies; resolves ids from requests."""

    def __init__(self, extra: dict[str, type] | None = None, *, entry_points_group: str | None = ENTRY_POINT_GROUP):
        self.custom: dict[str, type] = {}
        if entry_points_group:
            for ep in entry_points(group=entry_points_group):
                try:
                    self.custom[ep.name] = ep.load()
                except Exception as exc:  # one broken plugin must not stop the server
                    log.warning("press entry point %s failed to load: %s", ep.name, exc)
        self.custom.update(extra or {})

    def names(self) -> list[str]:
        return [*BUILTIN, *self.custom, "kvpress:<PressClass>"]

    def examples(self) -> list[str]:
        return ["full", "snapkv@0.5", "snapkv#512", "snapkv@0.5:window_size=32", "recent@0.5",
                "streaming@0.5", "kvpress:KnormPress@0.5", *(f"{n}@0.5" for n in self.custom)]

    def resolve(self, policy_id: str) -> Policy:
        """Parse and look up a policy id; raises :class:`PolicyError` with the reason."""
        try:
            spec = parse_policy_id(policy_id)
        except PolicyIdError as exc:
            raise PolicyError(str(exc)) from None
        if spec.name in BUILTIN:
            policy: Policy = BUILTIN[spec.name](spec)
        elif spec.name in self.custom:
            policy = PressClassPolicy(spec, press_cls=self.custom[spec.name])
        elif spec.name.startswith("kvpress:"):
            policy = PressClassPolicy(spec, press_cls=_kvpress_class(spec))
        else:
            raise PolicyError(f"unknown policy {spec.name!r}; known: {', '.join(self.names())}")
        if not spec.is_full and spec.budget < 1 and math.isnan(spec.retention):
            raise PolicyError(f"policy {policy_id!r} needs @<retention> or #<budget>")
        if spec.params and isinstance(policy, FullPolicy):
            raise PolicyError(f"policy {policy_id!r}: 'full' takes no parameters")
        # Build once on a notional prompt so bad :k=v parameters fail at validation.
        if not isinstance(policy, FullPolicy):
            policy.make_press(0.5, 1 << 16)
        return policy


def _kvpress_class(spec: PolicySpec) -> type:
    import kvpress

    cls_name = spec.name.split(":", 1)[1]
    cls = getattr(kvpress, cls_name, None)
    if not isinstance(cls, type) or not cls_name.endswith("Press"):
        raise PolicyError(f"unknown kvpress press {cls_name!r}")
    return cls

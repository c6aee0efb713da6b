"""Policy registry: policy ids (``protocols.parse_policy_id``) -> kvpress presses.

One interface, :class:`Policy`: given the prompt length it builds a *fresh* kvpress
press (presses keep per-run state) and says what to expect. Compression happens
during prefill, as kvpress does it: each attention layer attends to the whole prompt
and its cache is compressed right after, so the first new token's distribution is
exactly the full model's (step-1 TV = 0) and eviction acts from step 2 on. Presses
that also act while decoding (DecodingPress, PrefillDecodingPress, DMSPress with
``decoding=true``, CAMPress) are flagged in the :class:`PressPlan`; the engine runs their
hooks around the candidate's decoding forwards only. What a press is (acts while
decoding, re-rotates, ...) is read in :mod:`gen_service.presses.traits`.

A ``+quant:kivi@<bits>`` suffix (or ``quant:kivi@<bits>`` alone) quantizes the cache
as well (gen_service/presses/quantized.py): the :class:`PressPlan` carries the quantizer's settings
and the engine builds the quantized cache at prefill. Presses whose artifact the
operator supplies as local files load it from there (gen_service/presses/artifacts.py).
Everything the registry knows about one press class (aliases, where its amount goes,
its artifact, attributes set after construction) is its row of the press table,
:mod:`gen_service.presses.table`.

Names: the short aliases in :data:`ALIASES` (``snapkv``, ``adakv``, ``pyramidkv``...),
any kvpress press class (``kvpress:SnapKVPress`` or ``SnapKVPress``), wrappers with
inner presses in parentheses, entry point group ``kvdiv.presses`` (name -> press
class) and ``--press NAME=module:Class`` at server start (never from a request).

The one validation entry point is :meth:`PolicyRegistry.build`: it parses the id,
checks every parameter (type, range, server-side or not, budgets within the model's
context) and constructs the press once, raising :class:`PolicyError` before anything
streams.
"""

from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from typing import Any

from gen_service.errors import PolicyError
from gen_service.presses.artifacts import LOCAL_ARTIFACTS, OPTION_KEYS, artifact_path, attach, check_options
from gen_service.presses.families import ModelFeatures, Refusal, refusal
from gen_service.presses.kivi import KIVIConfig
from gen_service.presses.params import ATTRIBUTE_PARAMS, check_value, param_specs, press_slots
from gen_service.presses.table import PRESSES, by_name, lineage
from gen_service.presses.traits import acts_while_decoding, check_quantizable, rerotates
from protocols import PolicyIdError, PolicySpec, PressTerm, parse_option_value, parse_policy_id

__all__ = ["ALIASES", "ModelInfo", "PressPlan", "Policy", "PolicyRegistry", "expected_kept",
           "load_class", "parse_press_option"]

log = logging.getLogger("kvdiv.service")

ENTRY_POINT_GROUP = "kvdiv.presses"

# Short names for the methods people compare (expression, default parameters), from the press table.
ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    a.name: (a.expression, dict(a.defaults)) for p in PRESSES for a in p.aliases
}
_SERVER_KEYS = {"allow_download"} | OPTION_KEYS


@dataclass(frozen=True)
class ModelInfo:
    """The model facts a policy is checked against (``features``: what the designed
    refusals read, :mod:`gen_service.presses.families`; None for no model)."""

    max_context: int = 1 << 20
    num_layers: int = 0
    features: ModelFeatures | None = None

    @classmethod
    def of(cls, lm: Any) -> ModelInfo:
        """From a :class:`gen_service.models.loading.LoadedModel` (or anything with those fields)."""
        model = getattr(lm, "model", None)
        config = getattr(model, "config", None)
        # a causal LM's decoder layers (anything else, e.g. a test's stand-in, has no features)
        features = ModelFeatures.of(model) if hasattr(getattr(model, "model", None), "layers") else None
        return cls(max_context=int(lm.max_context), num_layers=int(getattr(config, "num_hidden_layers", 0) or 0),
                   features=features)


@dataclass
class PressPlan:
    """What a policy will do to one prompt."""

    press: Any | None          # a fresh kvpress press, or None: keep the whole prompt
    expected_kept: int         # prompt tokens expected to stay in the cache (uniform presses)
    note: str = ""             # e.g. "prompt shorter than budget: kept whole"
    params: dict[str, Any] = field(default_factory=dict)
    decoding: bool = False     # the press also compresses during decoding
    rerotates: bool = False    # kept keys are re-rotated to positions 0..kept-1
    quant: KIVIConfig | None = None   # the cache is quantized


@dataclass
class _Node:
    """One press of a policy, checked: class, request parameters, inner presses, amount."""

    cls: type
    kwargs: dict[str, Any]
    children: list[_Node]
    retention: float = math.nan
    budget: int = -1
    amount_field: str | None = None
    shown: set[str] = field(default_factory=set)   # parameters the header reports (not server options)
    artifact: str | None = None                    # a local folder the press loads its artifact from

    @property
    def name(self) -> str:
        return self.cls.__name__

    def ratio(self, prompt_len: int) -> float:
        if self.budget >= 1:
            return 0.0 if prompt_len <= self.budget else 1.0 - (self.budget + 0.5) / prompt_len
        return 1.0 - self.retention

    def make(self, prompt_len: int, num_layers: int) -> Any:
        kwargs = dict(self.kwargs)
        kids = [c.make(prompt_len, num_layers) for c in self.children]
        for (slot, is_list, _), chunk in zip(press_slots(self.cls), _split_children(self.cls, kids), strict=True):
            if is_list:
                kwargs[slot] = chunk
            elif chunk:
                kwargs[slot] = chunk[0]
        if self.amount_field == "compression_ratios":
            kwargs.setdefault("compression_ratios", [self.ratio(prompt_len)] * max(num_layers, 1))
        elif self.amount_field == "target_size":
            kwargs["target_size"] = self.budget
        elif self.amount_field:
            kwargs[self.amount_field] = max(self.ratio(prompt_len), 0.0)
        attrs = {k: kwargs.pop(k) for k in list(kwargs) if k in ATTRIBUTE_PARAMS.get(self.name, {})}
        spec = by_name(self.name)
        for key, value in (spec.attributes if spec is not None else {}).items():
            attrs.setdefault(key, value)
        _fit(self, kwargs, attrs, prompt_len)
        press = self.cls(**kwargs)
        for key, value in attrs.items():
            setattr(press, key, value)
        if self.artifact is not None:
            attach(press, self.artifact)
        for key, value in (spec.fixed if spec is not None else {}).items():
            setattr(press, key, value)   # e.g. FinchPress: no delimiter in the prompt, the window is given
        return press


def _fit(node: _Node, kwargs: dict[str, Any], attrs: dict[str, Any], prompt_len: int) -> None:
    """kvpress asserts windows and sinks shorter than the prompt; short prompts use what
    they have (the header's candidate.params report the values used)."""
    for key in ("window_size", "n_sink", "sink"):
        if key in param_specs(node.cls) and prompt_len > 1:
            where = attrs if key in attrs else kwargs
            value = where.get(key, _default(node.cls, key))
            if isinstance(value, int) and value >= prompt_len:
                where[key] = prompt_len - 1


def _default(cls: type, name: str) -> Any:
    import inspect

    param = inspect.signature(cls.__init__).parameters.get(name)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


def _split_children(cls: type, kids: list[Any]) -> list[list[Any]]:
    """Inner presses in slot order; a list slot takes all the rest."""
    out, i = [], 0
    for _, is_list, _ in press_slots(cls):
        if is_list:
            out.append(kids[i:])
            i = len(kids)
        else:
            out.append(kids[i:i + 1])
            i += 1
    return out


@dataclass
class Policy:
    """A checked policy id: builds a fresh press per prompt."""

    spec: PolicySpec
    root: _Node | None = None
    info: ModelInfo = field(default_factory=ModelInfo)
    quant: KIVIConfig | None = None   # for "+quant:" / "quant:" ids

    @property
    def press_name(self) -> str:
        return "none" if self.root is None else self.root.name

    def compression_ratio(self, prompt_len: int) -> tuple[float, str]:
        """kvpress's compression_ratio (fraction removed) of the outer amount, and a note
        when a budget keeps the whole prompt."""
        if self.root is None or self.root.amount_field == "target_size":
            return math.nan, ""   # nothing removed at prefill, or no single outer ratio
        if self.spec.budget >= 1 and prompt_len <= self.spec.budget:
            return 0.0, f"prompt of {prompt_len} tokens is within the budget {self.spec.budget}: kept whole"
        if self.spec.budget >= 1:
            return 1.0 - (self.spec.budget + 0.5) / prompt_len, ""
        return 1.0 - self.spec.retention, ""

    def plan(self, prompt_len: int) -> PressPlan:
        plan = self._press_plan(prompt_len)
        if self.quant is not None:
            plan.quant = self.quant
            plan.params.update(self.quant.params())
        return plan

    def _press_plan(self, prompt_len: int) -> PressPlan:
        if self.root is None:
            return PressPlan(None, prompt_len)
        ratio, note = self.compression_ratio(prompt_len)
        if note or prompt_len < 2:
            return PressPlan(None, prompt_len, note or "nothing to evict")
        press = self.root.make(prompt_len, self.info.num_layers)
        params: dict[str, Any] = {} if math.isnan(ratio) else {"compression_ratio": ratio}
        # in the constructor's keyword order, not the set's: a set of strings iterates in
        # PYTHONHASHSEED's order, and the header (and its digest) must not vary by process
        shown = {k: v for k, v in self.root.kwargs.items() if k in self.root.shown}
        shown.update((k, v) for k, v in self.spec.params.items() if "." not in k)
        params.update({k: _plain(getattr(press, k, v)) for k, v in shown.items()})
        kept = prompt_len if math.isnan(ratio) else expected_kept(prompt_len, ratio)
        return PressPlan(press, kept, note, params, decoding=acts_while_decoding(press), rerotates=rerotates(press))

    def describe(self) -> dict[str, Any]:
        return {"policy": self.spec.id, "press": self.press_name,
                "retention": None if math.isnan(self.spec.retention) else self.spec.retention,
                "budget": self.spec.budget}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, bool, str, type(None), list)) else repr(value)


def expected_kept(prompt_len: int, ratio: float) -> int:
    from kvpress.utils import compute_n_kept

    return compute_n_kept(prompt_len, ratio) if ratio > 0 else prompt_len


def load_class(target: str) -> type:
    """``module:Class`` -> the class (for ``--press``)."""
    module_name, _, attr = target.partition(":")
    if not attr:
        raise PolicyError(f"--press {target!r}: expected module:Class")
    return getattr(importlib.import_module(module_name), attr)


def parse_press_option(text: str) -> tuple[str, str, Any]:
    """``Class:key=value`` (``kvdiv serve --press-option``) -> (Class, key, value)."""
    cls_name, sep, rest = text.partition(":")
    key, eq, value = rest.partition("=")
    if not sep or not eq or not cls_name or not key:
        raise PolicyError(f"--press-option {text!r}: expected Class:key=value")
    return cls_name.strip(), key.strip(), parse_option_value(value.strip())


class PolicyRegistry:
    """Maps policy names to policies; builds and checks ids from requests.

    Parameters
    ----------
    extra : dict, optional
        Custom presses, name -> press class (``--press``).
    entry_points_group : str or None
        Entry point group to load more presses from; None loads none.
    press_options : dict, optional
        Server-side options, press class name -> {parameter: value}
        (``--press-option Class:key=value``): paths, datasets, download permission.
    """

    def __init__(self, extra: dict[str, type] | None = None, *, entry_points_group: str | None = ENTRY_POINT_GROUP,
                 press_options: dict[str, dict[str, Any]] | None = None):
        self.custom: dict[str, type] = {}
        if entry_points_group:
            for ep in entry_points(group=entry_points_group):
                try:
                    self.custom[ep.name] = ep.load()
                except Exception as exc:  # one broken plugin must not stop the server
                    log.warning("press entry point %s failed to load: %s", ep.name, exc)
        self.custom.update(extra or {})
        self.press_options = {k: dict(v) for k, v in (press_options or {}).items()}
        check_options(self.press_options)
        #: table trait -> why every press with it is refused on the loaded model (the
        #: start-up self-check's compressed probe failed: gen_service.serving.self_check)
        self.disabled: dict[str, Refusal] = {}
        self._refusals: dict[Any, dict[str, Refusal]] = {}

    def names(self) -> list[str]:
        return ["full", *ALIASES, *self.custom, "kvpress:<PressClass>"]

    def examples(self) -> list[str]:
        return ["full", "snapkv@0.5", "snapkv#512", "snapkv@0.5:window_size=32", "recent@0.5",
                "streaming@0.5", "adakv@0.5", "kvpress:KnormPress@0.5",
                "kvpress:ChunkKVPress(SnapKVPress)@0.5:chunk_length=8",
                "kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=64",
                "quant:kivi@2", "quant:kivi@4:group_size=64,residual_length=64",
                "snapkv@0.5+quant:kivi@4", "kvpress:SnapKVPress@0.5:window_size=32+quant:kivi@2:key_axis=token",
                *(f"{n}@0.5" for n in self.custom)]

    def build(self, policy_id: str, model_info: ModelInfo | None = None) -> Policy:
        """Parse, check and build a policy id once; the validation entry point.

        Parameters
        ----------
        policy_id : str
            A policy id (docs/service.md, "Eviction policies").
        model_info : ModelInfo, optional
            Bounds to check budgets and sizes against (the model's context).

        Returns
        -------
        Policy
            Ready to :meth:`Policy.plan` a prompt.

        Raises
        ------
        PolicyError
            Naming what is wrong (``field`` names the parameter when there is one).
        """
        info = model_info or ModelInfo()
        try:
            spec = parse_policy_id(policy_id)
        except PolicyIdError as exc:
            raise PolicyError(str(exc)) from None
        if spec.is_full:
            return Policy(spec, None, info)
        quant = None
        if spec.quant is not None:
            quant = KIVIConfig.from_term(spec.quant, spec.id, info.max_context)
        if spec.press is None:
            return Policy(spec, None, info, quant)
        if spec.budget > info.max_context:
            raise PolicyError(f"policy {spec.id!r}: budget {spec.budget} exceeds the model's context "
                              f"({info.max_context} tokens)", "budget")
        root = self._node(spec.id, spec.press, defaults={})
        _route_params(spec.id, root, spec.params, info)
        self._local_artifacts(spec.id, root)
        _assign_amounts(spec.id, root, inherited=False)
        policy = Policy(spec, root, info, quant)
        try:  # construct once on a notional prompt so kvpress's own checks fail now
            press = root.make(min(info.max_context, 4096), info.num_layers)
        except PolicyError:
            raise
        except (AssertionError, TypeError, ValueError, AttributeError) as exc:
            raise PolicyError(f"policy {spec.id!r}: {root.name} cannot be built: {exc or type(exc).__name__}") from None
        found = refusal(press, info.features, self.disabled)
        if found is not None:   # by design: the same request can never succeed on this model
            raise PolicyError(f"policy {spec.id!r}: {found.message}", "press", permanent=True)
        if quant is not None:
            check_quantizable(spec.id, press)
        return policy

    def refusals(self, info: ModelInfo) -> dict[str, Refusal]:
        """Every press class of the table refused on the model ``info`` describes, by
        name (``GET /v1/policies``): each row's example press checked as a request's is."""
        key = (info, tuple(sorted(self.disabled.items(), key=lambda kv: kv[0])))
        if key in self._refusals:
            return dict(self._refusals[key])
        out: dict[str, Refusal] = {}
        bare = replace(info, features=None, num_layers=0)   # the press alone; the rules below
        for row in PRESSES:
            if not row.kinds:
                continue   # not a method, or needs an artifact: the catalog's reason says so
            try:
                press = self.build(row.example, bare).plan(4096).press
            except PolicyError:
                continue
            found = refusal(press, info.features, self.disabled)
            if found is not None:
                out[row.name] = found
        self._refusals[key] = out
        return dict(out)

    resolve = build  # the name the HTTP layer used before build() existed

    # ------------------------------------------------------------------ building

    def _class(self, policy_id: str, name: str) -> type:
        bare = name.split(":", 1)[1] if name.startswith("kvpress:") else name
        if not name.startswith("kvpress:") and name in self.custom:
            return self.custom[name]
        import kvpress

        cls = getattr(kvpress, bare, None)
        if not isinstance(cls, type) or not bare.endswith("Press") or bare not in kvpress.__all__:
            raise PolicyError(f"policy {policy_id!r}: unknown press {name!r}; known: {', '.join(self.names())}",
                              "press")
        spec = by_name(bare)
        if spec is not None and spec.refused:   # abstract, or a press the engine cannot run
            raise PolicyError(f"policy {policy_id!r}: {bare}: {spec.reason}", "press")
        return cls

    def _node(self, policy_id: str, term: PressTerm, defaults: dict[str, Any]) -> _Node:
        if term.name in ALIASES:
            expression, alias_defaults = ALIASES[term.name]
            if term.args:
                raise PolicyError(f"policy {policy_id!r}: alias {term.name!r} ({expression}) takes no inner press")
            inner = parse_policy_id(expression).press
            assert inner is not None
            inner = PressTerm(inner.name, inner.args, term.retention, term.budget)
            return self._node(policy_id, inner, {**alias_defaults, **defaults})
        cls = self._class(policy_id, term.name)
        self._check_artifact(policy_id, cls)
        slots = press_slots(cls)
        required = sum(1 for _, is_list, req in slots if req and not is_list)
        has_list = any(is_list for _, is_list, _ in slots)
        if len(term.args) < required or (not has_list and len(term.args) > len(slots)) or (has_list and not term.args):
            names = ", ".join(s for s, _, _ in slots) or "none"
            raise PolicyError(f"policy {policy_id!r}: {cls.__name__} takes inner presses ({names}); "
                              f"got {len(term.args)}", "press")
        children = [self._node(policy_id, arg, {}) for arg in term.args]
        kwargs = {k: v for k, v in self.press_options.get(cls.__name__, {}).items() if k not in _SERVER_KEYS}
        kwargs.update(defaults)
        return _Node(cls, kwargs, children, term.retention, term.budget, shown=set(defaults))

    def _check_artifact(self, policy_id: str, cls: type) -> None:
        spec = by_name(cls.__name__)
        artifact = None if spec is None else spec.artifact
        options = self.press_options.get(cls.__name__, {})
        if artifact is None or options.get("allow_download") is True:
            return
        if any(options.get(k) for k in artifact.keys):
            return   # which folder (variant) is checked once the parameters are known
        raise PolicyError(f"policy {policy_id!r}: {cls.__name__} needs {artifact.need(cls.__name__)}; this server "
                          f"has none. The operator "
                          f"supplies it with `kvdiv serve --press-option {cls.__name__}:...` (never a request)",
                          "press")

    def _local_artifacts(self, policy_id: str, root: _Node) -> None:
        """Point each press with an operator-supplied artifact at its folder; refuse a
        variant the operator supplied none for."""
        for node in _walk(root):
            options = self.press_options.get(node.name, {})
            if node.name not in LOCAL_ARTIFACTS or options.get("allow_download") is True:
                continue
            folder, key = artifact_path(node.name, options, node.kwargs)
            if folder is None:
                raise PolicyError(f"policy {policy_id!r}: {node.name} with these parameters needs the operator's "
                                  f"`--press-option {node.name}:{key}=DIR`; this server has none", "press")
            node.artifact = folder


def _walk(node: _Node) -> list[_Node]:
    return [node, *(n for c in node.children for n in _walk(c))]


def _target(policy_id: str, root: _Node, key: str) -> tuple[_Node, str]:
    """The node a (possibly dotted) parameter key addresses, and the bare name."""
    *hops, name = key.split(".")
    node = root
    for hop in hops:
        slot_names = [s for s, _, _ in press_slots(node.cls)]
        if hop.isdigit() and int(hop) < len(node.children):
            node = node.children[int(hop)]
        elif hop in slot_names and slot_names.index(hop) < len(node.children):
            node = node.children[slot_names.index(hop)]
        else:
            raise PolicyError(f"policy {policy_id!r}: parameter {key!r}: {node.name} has no inner press {hop!r}", key)
    if hops:
        return node, name
    owners = [n for n in _walk(root) if name in param_specs(n.cls)]
    if name in param_specs(root.cls):
        return root, name
    if len(owners) == 1:
        return owners[0], name
    if len(owners) > 1:
        raise PolicyError(f"policy {policy_id!r}: parameter {key!r} fits several inner presses; "
                          f"address one as <index>.{name}", key)
    return root, name


def _route_params(policy_id: str, root: _Node, params: dict[str, object], info: ModelInfo) -> None:
    for key, value in params.items():
        node, name = _target(policy_id, root, key)
        where = f"policy {policy_id!r}"
        if name in ("compression_ratio", "key_channel_compression_ratio", "head_compression_ratio",
                    "target_compression_ratio") and name in param_specs(node.cls):
            raise PolicyError(f"{where}: set the amount kept with @<retention> or #<budget>, not {name}", key)
        specs = param_specs(node.cls)
        if name not in specs:
            if name in _server_side_names(node.cls):
                raise PolicyError(f"{where}: {node.name}.{name} names a file, dataset or hub repository: it is a "
                                  f"server-side option (`kvdiv serve --press-option {node.name}:{name}=...`), "
                                  f"never a request field", key)
            known = ", ".join(specs) or "none"
            raise PolicyError(f"{where}: press {node.name} has no parameter {name!r} (request-settable: {known})", key)
        node.kwargs[name] = check_value(specs[name], value, where, info.max_context)
        node.shown.add(name)
        if name == "compression_ratios" and info.num_layers and len(node.kwargs[name]) != info.num_layers:
            raise PolicyError(f"{where}: compression_ratios needs one ratio per layer ({info.num_layers})", key)


def _server_side_names(cls: type) -> set[str]:
    import inspect

    return {p for p in inspect.signature(cls.__init__).parameters if p != "self"} - set(param_specs(cls))


def _own_amount_field(cls: type, budget: bool) -> str | None:
    for spec in lineage(cls):
        if spec.absolute:
            return spec.amount_field if budget else None
        if spec.amount_field:
            return spec.amount_field
    return "compression_ratio" if "compression_ratio" in param_specs(cls) else None


def _assign_amounts(policy_id: str, node: _Node, inherited: bool) -> None:
    """Give each amount ("@r", "#b") a field: the press's own ratio, else its single inner
    press's. Presses that need one and get none are refused."""
    where = f"policy {policy_id!r}"
    has = node.budget >= 1 or not math.isnan(node.retention)
    # these wrappers set their inner press's ratio themselves
    sets_inner = any(spec.sets_inner_amount for spec in lineage(node.cls))
    own = _own_amount_field(node.cls, node.budget >= 1)
    if has and own is None and any(spec.absolute for spec in lineage(node.cls)):
        raise PolicyError(f"{where}: {node.name} keeps an absolute number of tokens: use #<budget> "
                          f"or target_size=, not @", "press")
    if has and own is None:
        if len(node.children) == 1 and not (node.children[0].budget >= 1 or not math.isnan(node.children[0].retention)):
            kid = node.children[0]
            kid.retention, kid.budget = node.retention, node.budget
            node.retention, node.budget = math.nan, -1
        else:
            raise PolicyError(f"{where}: {node.name} takes no @<retention> or #<budget>; give its inner presses "
                              f"their own, or set its parameters", "press")
    elif has:
        if own == "key_channel_compression_ratio" and node.budget >= 1:
            raise PolicyError(f"{where}: {node.name} prunes key channels: use @<fraction of channels kept>", "press")
        node.amount_field = own
    elif own in ("compression_ratio",) and not inherited and own not in node.kwargs:
        raise PolicyError(f"{where}: {node.name} needs @<retention> or #<budget>", "press")
    for kid in node.children:
        _assign_amounts(policy_id, kid, inherited=inherited or sets_inner)

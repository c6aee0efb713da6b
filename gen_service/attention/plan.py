"""Which path each attention feature of a model takes, decided once at load.

kvdiv decodes through its own cascade attention (:mod:`gen_service.attention.cascade`), not the
model's attention function. Everything an architecture does to attention beyond plain
causal softmax attention must therefore be reproduced there, layer by layer, or the model
refused: P must be the model a user loaded. :func:`attention_plan` reads the features
from the model's config and attention modules, decides each one's path from
:data:`FEATURES` (a table, one row per feature), switches a soft-capped model to eager
attention (transformers' SDPA function drops the soft cap), and raises
:class:`AttentionRefused` naming the feature and the model where no path reproduces it.
What projections, norms and rotary embeddings do before attention (q/k norms, biases,
rope scaling, local and global rope) is the model's own code on every path.

The plan is logged at load and reported by ``/info`` and every trace header
(:meth:`AttentionPlan.info`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from gen_service.errors import AttentionRefused

log = logging.getLogger("kvdiv.service")

__all__ = ["FEATURES", "AttentionPlan", "Feature", "LayerAttention", "attention_plan",
           "layer_windows"]


@dataclass(frozen=True)
class Feature:
    """One row of :data:`FEATURES`: an attention feature, where it is read, its path and cost."""

    name: str
    detected: str
    path: str
    cost: str
    supported: bool = True


#: every attention feature the engine knows, and what it does with it
FEATURES: tuple[Feature, ...] = (
    Feature("sliding window", "config.layer_types / config.sliding_window; the `sliding_window` the layer "
            "passes its attention function",
            "cascade: keys outside each query's window masked, by position (prompt slot i = position i; "
            "rows' own slots carry their positions)",
            "CPU: the fused kernel with a mask bias; CUDA: explicit softmax over the prompt for those layers; "
            "the layer is never compressed"),
    Feature("attention logit soft-cap", "config.attn_logit_softcapping (the layer's `softcap`)",
            "cascade, explicit softmax with capped scores; the model runs eager attention (SDPA drops the cap)",
            "a (queries × prompt) score matrix per layer and step instead of the fused kernel"),
    Feature("attention sinks", "the attention module's `sinks` (the layer's `s_aux`)",
            "cascade: one more logit per head in the log-sum-exp merge, no value", "none"),
    Feature("final logit soft-cap / logit scale", "config.final_logit_softcapping, logit_scale, logits_scaling",
            "the float32 head (gen_service.models.float_head)", "none"),
    Feature("q/k norms, biases, rope scaling, local/global rope, embedding scale",
            "inside the model's projections and rotary embeddings",
            "the model's own code, before attention, on every path", "none"),
    Feature("chunked attention", "config.layer_types 'chunked_attention' / attention_chunk_size (Llama 4)",
            "refused at load", "-", supported=False),
    Feature("other layer types", "config.layer_types values other than full / sliding (linear attention, "
            "state-space layers)", "refused at load", "-", supported=False),
)
_BY_NAME = {f.name: f for f in FEATURES}
_MODEL_OWN = "q/k norms, biases, rope scaling, local/global rope, embedding scale"


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention: its type, window, soft cap, sinks, and the path it takes."""

    index: int
    kind: str                 # "full" or "sliding"
    window: int | None
    softcap: float | None
    sinks: bool
    path: str                 # "cascade" or "cascade-explicit" (soft-capped scores)


@dataclass(frozen=True)
class AttentionPlan:
    """A model's attention, layer by layer, and the features it uses (rows of :data:`FEATURES`)."""

    model: str
    layers: tuple[LayerAttention, ...]
    features: tuple[str, ...]
    attn_implementation: str

    @property
    def windowed(self) -> list[int]:
        """Layers with a sliding window: kept whole by every press (gen_service.presses.layered)."""
        return [la.index for la in self.layers if la.window is not None]

    @property
    def compressible(self) -> list[int]:
        """Layers a press may compress: the full-attention ones."""
        return [la.index for la in self.layers if la.window is None]

    def info(self) -> dict[str, Any]:
        """The plan as ``/info`` and the trace header report it (JSON-ready)."""
        kinds = sorted({la.kind for la in self.layers})
        return {
            "layer_types": {k: [la.index for la in self.layers if la.kind == k] for k in kinds},
            "windows": sorted({la.window for la in self.layers if la.window is not None}),
            "features": [{"feature": f, "path": _BY_NAME[f].path, "cost": _BY_NAME[f].cost} for f in self.features],
            "explicit_layers": [la.index for la in self.layers if la.path == "cascade-explicit"],
            "attn_implementation": self.attn_implementation,
        }

    def header(self) -> dict[str, Any]:
        """The plan in a trace header (docs/contract.md §3): the windowed layers and their
        windows, the features beyond plain attention, and the layers on the explicit softmax."""
        return {"layers": len(self.layers), "windowed_layers": self.windowed,
                "windows": sorted({la.window for la in self.layers if la.window is not None}),
                "features": [f for f in self.features if f != _MODEL_OWN],
                "explicit_layers": [la.index for la in self.layers if la.path == "cascade-explicit"]}

    def table(self) -> str:
        """The plan as a plain-text table (logged at load)."""
        rows = [f"attention plan for {self.model} ({len(self.layers)} layers, {self.attn_implementation}):"]
        for f in self.features:
            rows.append(f"  {f}: {_BY_NAME[f].path} [cost: {_BY_NAME[f].cost}]")
        for kind, idx in self.info()["layer_types"].items():
            rows.append(f"  {kind} layers: {idx}")
        return "\n".join(rows)


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from the config as the model's
    own mask functions read it."""
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:             # Mistral, Phi-3, Starcoder2: one window for every layer, or none
        return [window] * n
    return [window if t == "sliding_attention" else None for t in types]


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise AttentionRefused(f"{type(model).__name__}: no decoder layers with `self_attn` modules "
                               "(model.model.layers[i].self_attn); kvdiv cannot route its attention")
    return list(layers)


def attention_plan(model: torch.nn.Module, name: str | None = None) -> AttentionPlan:
    """Read a causal LM's attention features and decide each one's path (see :data:`FEATURES`).

    Switches a model with attention soft-capping to eager attention (the model's own
    forward then applies the cap, as the cascade's explicit path does).

    Raises
    ------
    AttentionRefused
        A feature no path reproduces (chunked attention, an unknown layer type), named
        with the model.
    """
    config = model.config
    name = name or getattr(config, "name_or_path", None) or type(model).__name__
    arch = getattr(config, "model_type", type(model).__name__)
    types = getattr(config, "layer_types", None)
    for t in set(types or ()):
        if t == "chunked_attention":
            raise AttentionRefused(f"{name} ({arch}): chunked attention (attention_chunk_size="
                                   f"{getattr(config, 'attention_chunk_size', None)}) is not reproduced by kvdiv's "
                                   "decoding path; refusing to serve a different model")
        if t not in ("full_attention", "sliding_attention"):
            raise AttentionRefused(f"{name} ({arch}): layer type {t!r} is not reproduced by kvdiv's decoding path; "
                                   "refusing to serve a different model")
    if getattr(config, "attention_chunk_size", None) and types is None:
        raise AttentionRefused(f"{name} ({arch}): chunked attention is not reproduced by kvdiv's decoding path")
    layers = _decoder_layers(model)
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and config._attn_implementation != "eager":
        log.info("%s: attention soft-cap %s: eager attention (%s drops the cap)", name, softcap,
                 config._attn_implementation)
        model.set_attn_implementation("eager")
    windows = layer_windows(config)
    plan = []
    for i, (layer, w) in enumerate(zip(layers, windows, strict=True)):
        sinks = isinstance(getattr(layer.self_attn, "sinks", None), torch.Tensor)
        plan.append(LayerAttention(i, "full" if w is None else "sliding", None if w is None else int(w),
                                   softcap, sinks, "cascade" if softcap is None else "cascade-explicit"))
    features = [f for f, on in (
        ("sliding window", any(la.window is not None for la in plan)),
        ("attention logit soft-cap", softcap is not None),
        ("attention sinks", any(la.sinks for la in plan)),
        ("final logit soft-cap / logit scale", any(getattr(config, k, None) not in (None, False) for k in
                                                   ("final_logit_softcapping", "logit_scale", "logits_scaling"))),
        (_MODEL_OWN, True),
    ) if on]
    made = AttentionPlan(name, tuple(plan), tuple(features), config._attn_implementation)
    log.info(made.table())
    return made

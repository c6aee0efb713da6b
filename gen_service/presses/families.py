"""Which press runs on which model: the designed refusals, one rule per model feature.

A press that cannot run on the loaded model is refused when its policy is built
(:meth:`gen_service.presses.registry.PolicyRegistry.build`, a 422 marked ``permanent``),
listed per loaded model at ``GET /v1/policies``, and shown in docs/presses-by-family.md
(generated from tests/test_presses_families.py's matrix by benchmarks/conformance_table.py).
Each rule joins a trait of the press table (:mod:`gen_service.presses.table`) with a
feature of the model (:class:`ModelFeatures`):

======================  ===============================================  ============================
press trait             model feature                                    why it cannot run
======================  ===============================================  ============================
``rotates_queries``     rotary cos/sin narrower than the head            kvpress rotates queries at
                        (Phi-3 partial rotary, GPT-OSS's half-width;     the full head width
                        not under eager for ``weights_first`` presses)
``rerotates``           partial rotary (fewer channels rotated than      kvpress re-rotates the whole
                        the head has)                                    head from ``inv_freq``
``no_eager``            eager attention (the model's hooks receive       the press asserts attention
                        attention weights)                               weights are absent
``all_layers``          sliding-window layers                            the press compresses every
                                                                         layer, windowed ones too
``unsupported``         a model class kvpress refuses                    kvpress raises
======================  ===============================================  ============================

Window attention (SnapKV and the presses scoring with it) is not refused on narrow rotary:
kvdiv rotates its queries as the model does (:mod:`gen_service.presses.rotary`). Beside
these rules, the start-up self-check may mark a trait unavailable on the loaded model
(``disabled``): it runs a window-attention press and, when that fails, every press with
the trait is refused with the failure as the reason.

A model whose every layer is windowed (Mistral, Phi-3 with a window) has no layer a
press compresses: every press then runs and keeps the whole prompt (docs/service.md),
except those scoring with passes of their own through every layer (``own_pass``: KVzip),
whose rotary rule holds there too.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gen_service.presses.table import lineage
from gen_service.presses.traits import iter_presses, rerotates

__all__ = ["ModelFeatures", "Refusal", "refusal"]


@dataclass(frozen=True)
class Refusal:
    """Why a press does not run on a model: the press, the model's feature, what would be needed.

    Examples
    --------
    >>> Refusal("ThinKPress", "Phi3ForCausalLM", "partial rotary", "a rotation of the rotated channels only").message
    'ThinKPress cannot run on Phi3ForCausalLM: partial rotary; it would need a rotation of the rotated channels only'
    """

    press: str
    model: str
    feature: str
    needed: str

    @property
    def message(self) -> str:
        return f"{self.press} cannot run on {self.model}: {self.feature}; it would need {self.needed}"

    def info(self) -> dict[str, str]:
        """The JSON object ``/v1/policies`` reports."""
        return {"press": self.press, "model": self.model, "feature": self.feature, "needed": self.needed,
                "reason": self.message}


@dataclass(frozen=True)
class ModelFeatures:
    """The model facts the refusal rules read (:meth:`of`).

    Attributes
    ----------
    model : str
        The model class name.
    head_dim : int
        Channels per attention head.
    rotary_dim : int
        Channels the rotary embedding rotates per head (``2 * len(inv_freq)``; ``head_dim``
        when unknown or the model has no rotary embedding).
    cos_width : int
        The width of the cos/sin the compressed layers receive.
    eager : bool
        The model runs eager attention (its layers return attention weights).
    windowed : bool
        Some layer has a sliding window or attention chunk.
    compressed_layers : int
        Layers a press compresses (the layered rule: those without a window).
    """

    model: str = ""
    head_dim: int = 0
    rotary_dim: int = 0
    cos_width: int = 0
    eager: bool = False
    windowed: bool = False
    compressed_layers: int = 0

    @classmethod
    def of(cls, model: Any) -> ModelFeatures:
        """The features of a loaded causal LM (cached per model)."""
        cached = _CACHE.get(model)
        if cached is None:
            cached = _CACHE[model] = _features(model)
        return cached


_CACHE: weakref.WeakKeyDictionary[Any, ModelFeatures] = weakref.WeakKeyDictionary()


def _features(model: Any) -> ModelFeatures:
    import torch

    from gen_service.attention.plan import layer_windows
    from gen_service.presses.layered import _layer_rotary, compressible_layers, rotary_free

    config = model.config
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    layers = compressible_layers(model)
    rotary_dim = cos_width = head_dim
    # the compressed layers' rotary, else any layer's (a press with passes of its own meets it)
    roped = [i for i in [*layers, *range(len(model.model.layers))] if not rotary_free(model, i)]
    if roped:
        rotary = _layer_rotary(model, roped[0])
        if rotary is not None:
            rotary_dim = 2 * int(rotary.inv_freq.shape[0])
            probe = torch.zeros(1, 1, head_dim, dtype=rotary.inv_freq.dtype, device=rotary.inv_freq.device)
            with torch.no_grad():
                cos, _ = rotary(probe, torch.zeros(1, 1, dtype=torch.long, device=probe.device))
            cos_width = int(cos.shape[-1])
    return ModelFeatures(model=type(model).__name__, head_dim=head_dim, rotary_dim=rotary_dim, cos_width=cos_width,
                         eager=getattr(config, "_attn_implementation", "") == "eager",
                         windowed=any(w is not None for w in layer_windows(config)), compressed_layers=len(layers))


def _has(press: Any, trait: str) -> bool:
    return any(getattr(spec, trait) for spec in lineage(type(press)))


def refusal(press: Any, features: ModelFeatures | None,
            disabled: Mapping[str, Refusal] | None = None) -> Refusal | None:
    """Why ``press`` (a kvpress press tree) cannot run on the model, or None.

    Parameters
    ----------
    press : kvpress press or None
    features : ModelFeatures or None
        The loaded model's (None: nothing known, nothing refused).
    disabled : mapping, optional
        Table trait -> the refusal the start-up self-check found for it on this model.

    Returns
    -------
    Refusal or None
        The first rule (module docstring) the press's tree breaks.
    """
    if press is None or features is None:
        return None
    m, f = features.model, features
    for p in iter_presses(press):
        name = type(p).__name__
        for trait, found in (disabled or {}).items():
            if _has(p, trait):
                return Refusal(name, m, found.feature, found.needed)
        if f.model in {c for spec in lineage(type(p)) for c in spec.unsupported}:
            return Refusal(name, m, f"kvpress refuses {name} for {m}", "kvpress support for that model class")
        if _has(p, "all_layers") and f.windowed:
            return Refusal(name, m, "sliding-window layers, which must keep every slot",
                           "compressing only the global layers (it compresses every layer itself, outside "
                           "kvpress's per-layer hooks)")
        if not f.compressed_layers and not _has(p, "own_pass"):
            continue   # no layer is compressed: the press keeps the whole prompt
        if _has(p, "no_eager") and f.eager:
            return Refusal(name, m, "eager attention (its layers hand attention weights to the press, which "
                                    "asserts there are none)",
                           "an attention implementation returning no weights (sdpa); the model needs eager for "
                           "its soft-capping or sinks")
        if _has(p, "rotates_queries") and f.cos_width < f.head_dim and not (f.eager and _has(p, "weights_first")):
            how = (f"partial rotary ({f.rotary_dim} of {f.head_dim} channels rotated)" if f.rotary_dim < f.head_dim
                   else f"a rotary embedding of {f.cos_width}-wide cos/sin rotating the head's two halves")
            return Refusal(name, m, how, "its queries rotated with the model's own apply_rotary_pos_emb instead "
                                         "of kvpress's full-width formula (as kvdiv does for SnapKV's window "
                                         "attention)")
        if f.rotary_dim < f.head_dim and rerotates(p):
            return Refusal(name, m, f"partial rotary ({f.rotary_dim} of {f.head_dim} channels rotated)",
                           "re-rotation of the rotated channels only (kvpress re-rotates the whole head)")
    return None

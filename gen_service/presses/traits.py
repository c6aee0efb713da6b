"""What a kvpress press is, as the engine and the registry need to know it.

A policy's press is a tree (wrappers, compositions); every question asked of it here
walks that tree with :func:`iter_presses`: does it act while decoding (its hooks run
around the candidate's decoding forwards), does it re-rotate the kept keys (decoding
continues from the kept count), does it score with attention weights (prefill under
eager attention), which per-row state does it keep across forwards (repeated when one
prefilled row becomes R), and can it compress a quantized cache exactly as kvpress does.

Which press has which trait is its row of the press table (:mod:`gen_service.presses.table`);
a trait of a kvpress class holds for its subclasses. This module imports no other press
module of gen_service but the table: :mod:`gen_service.presses.registry` (the registry)
and :mod:`gen_service.presses.quantized` (the caches) both read it.
kvpress is imported inside the functions that need its classes: importing it costs
seconds, and the registry's parsing and ``kvdiv --help`` must not pay it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gen_service.errors import PolicyError
from gen_service.presses.table import PRESSES, lineage

__all__ = ["ROW_STATE", "acts_while_decoding", "check_quantizable", "compresses_after_attention", "iter_presses",
           "repeat_rows", "rerotates", "wants_eager"]

# Per-layer state a decoding press keeps across forwards, batch first (the table's
# ``row_state``): kvpress's DecodingPress buffers its hidden states, DMSPress its scores,
# CAMPress its running attention sum. One prefilled row (the question goes in at batch 1)
# becomes R rows by repeating each, exactly the state R identical rows would have built.
ROW_STATE = tuple(dict.fromkeys(name for p in PRESSES for name in p.row_state))


def _has(press: Any, trait: str) -> bool:
    """Whether the press's row (or a kvpress base's) has ``trait``: True, or the name of
    the press's attribute that switches it on."""
    for spec in lineage(type(press)):
        value = getattr(spec, trait)
        if value is True or (isinstance(value, str) and value and getattr(press, value, False)):
            return True
    return False


def iter_presses(press: Any) -> Iterator[Any]:
    """A press and every press inside it (wrappers, compositions), outermost first."""
    yield press
    for name in ("press", "base_press", "prefilling_press", "decoding_press"):
        inner = getattr(press, name, None)
        if inner is not None and inner is not press and hasattr(inner, "forward_hook"):
            yield from iter_presses(inner)
    for inner in getattr(press, "presses", None) or ():
        yield from iter_presses(inner)


def acts_while_decoding(press: Any) -> bool:
    """Whether any press of the tree also compresses during decoding."""
    return any(_has(p, "decoding") for p in iter_presses(press))


def rerotates(press: Any) -> bool:
    """Whether the kept keys are re-rotated to positions 0..kept-1."""
    return any(_has(p, "rerotates") for p in iter_presses(press))


def wants_eager(press: Any) -> bool:
    """Presses that score with the attention weights (only eager attention returns them)."""
    return press is not None and any(_has(p, "eager") for p in iter_presses(press))


def compresses_after_attention(press: Any) -> bool:
    """Whether the press only compresses each layer's cache in kvpress's hook after that
    layer's attention, reading what the full model's forward computes there.

    Such a press leaves the forward the full model's, so its compressed cache can be
    derived from the one forward a document's prefill runs for P (and for every other
    candidate of that kind): :func:`gen_service.engine.prefill.prefill_document`. Not
    so, and prefilled by a forward of their own: presses that change the forward or
    the model (their own context manager: FinchPress, KVzip & co.), that have their own
    hook (decoding-time presses, DMS, CAM, RestoreKV, ...), that score with attention
    weights (eager attention: ObservedAttention, KVCompose), and those that draw from
    the global random generator (an unseeded RandomPress: the draws would interleave
    with the other candidates' layer by layer). :data:`None` (no press) qualifies.
    """
    if press is None:
        return True
    from kvpress import BasePress

    if wants_eager(press) or acts_while_decoding(press):
        return False
    for p in iter_presses(press):
        # a delegating press's hook calls its inner presses' hooks (ComposedPress, PerLayerCompressionPress)
        own_hook = type(p).forward_hook is not BasePress.forward_hook and not _has(p, "delegates_hook")
        own_context = type(p).__call__ is not BasePress.__call__
        if own_hook or own_context or _unseeded(p):
            return False
    return True


def _unseeded(press: Any) -> bool:
    """Whether the press draws from torch's global generator (its row's ``seed`` attribute is None)."""
    return any(spec.seed and getattr(press, spec.seed, None) is None for spec in lineage(type(press)))


def repeat_rows(press: Any, n: int) -> None:
    """Batch 1 -> n identical rows in every press's :data:`ROW_STATE`."""
    for p in iter_presses(press):
        for name in ROW_STATE:
            state = getattr(p, name, None)
            for layer, buf in (state or {}).items():
                state[layer] = ([t.repeat_interleave(n, 0) for t in buf] if isinstance(buf, list)
                                else buf.repeat_interleave(n, 0))


def check_quantizable(policy_id: str, press: Any) -> None:
    """Refuse presses that cannot compress a quantized cache exactly as kvpress does.

    kvpress compresses a ``QuantizedCache`` in ``BasePress.forward_hook`` (dequantize,
    compress, quantize). Presses with their own hook (decoding-time presses, KVzip &
    co.) edit the full-precision tensors directly, and head-wise presses (AdaKV & co.)
    leave per-head masks sized for a plain cache.

    Raises
    ------
    PolicyError
        Naming the press that cannot be combined.
    """
    from kvpress import BasePress

    for p in iter_presses(press):
        # a delegating press's hook calls its inner presses' hooks (ComposedPress, PerLayerCompressionPress)
        own_hook = type(p).forward_hook is not BasePress.forward_hook and not _has(p, "delegates_hook")
        if own_hook or _has(p, "per_head"):
            why = "masks keys per head" if not own_hook else "edits the cache in its own hook"
            raise PolicyError(f"policy {policy_id!r}: {type(p).__name__} {why}; it cannot be combined with a "
                              f"quantized cache (+quant:). Presses that compress through kvpress's "
                              f"BasePress hook can (SnapKV, Knorm, PyramidKV ...)", "quant")

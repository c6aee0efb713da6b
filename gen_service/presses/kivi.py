"""The settings of a ``quant:kivi@<bits>`` term, without torch (:mod:`gen_service.presses.quantized`
holds the caches themselves).

The registry checks policy ids with :class:`KIVIConfig`; keeping it apart from the torch
caches lets ``gen_service.presses.registry`` be imported (and ids checked) without torch
and transformers; :func:`gen_service.presses.quantized.kivi_cache` builds a cache from one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gen_service.errors import PolicyError
from protocols import QuantTerm

__all__ = ["AXES", "BITS", "KIVIConfig"]

BITS = (2, 4)                                  # as transformers' quanto backend allows
AXES = {"token": 0, "channel": -1}             # our names -> quanto's axis argument
_DEFAULTS = {"group_size": 32, "residual_length": 128, "key_axis": "channel", "value_axis": "token"}


@dataclass(frozen=True)
class KIVIConfig:
    """A checked ``quant:kivi@<bits>`` term: transformers' QuantizedCache settings.

    ``group_size`` is transformers' ``q_group_size``; ``key_axis``/``value_axis`` are
    quanto's ``axis_key``/``axis_value`` (``token`` = 0, ``channel`` = -1).
    """

    bits: int
    group_size: int = _DEFAULTS["group_size"]
    residual_length: int = _DEFAULTS["residual_length"]
    key_axis: str = _DEFAULTS["key_axis"]
    value_axis: str = _DEFAULTS["value_axis"]

    @classmethod
    def from_term(cls, term: QuantTerm, policy_id: str, max_context: int = 1 << 20) -> KIVIConfig:
        """Check a parsed ``quant:`` term.

        Parameters
        ----------
        term : protocols.QuantTerm
            The parsed quantizer.
        policy_id : str
            For error messages.
        max_context : int
            The model's context: the largest residual length that means anything.

        Returns
        -------
        KIVIConfig

        Raises
        ------
        PolicyError
            An unknown method, bit width or parameter, or a value out of range.
        """
        where = f"policy {policy_id!r}"
        if term.method != "kivi":
            raise PolicyError(f"{where}: unknown quantizer {term.method!r}; known: kivi", "quant")
        if term.bits not in BITS:
            raise PolicyError(f"{where}: quant:kivi takes @2 or @4 bits, not @{term.bits}", "quant")
        kwargs: dict[str, Any] = {}
        for key, value in term.params.items():
            if key not in _DEFAULTS:
                raise PolicyError(f"{where}: quant:kivi has no parameter {key!r} "
                                  f"(known: {', '.join(_DEFAULTS)})", key)
            if key.endswith("_axis"):
                if value not in AXES:
                    raise PolicyError(f"{where}: {key} must be one of {', '.join(AXES)}, not {value!r}", key)
            elif isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_context:
                raise PolicyError(f"{where}: {key} must be an integer in [1, {max_context}], not {value!r}", key)
            kwargs[key] = value
        return cls(term.bits, **kwargs)

    def params(self) -> dict[str, Any]:
        """The settings, as the trace header's candidate parameters report them."""
        return {"quant": "kivi", **asdict(self)}

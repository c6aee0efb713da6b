"""The one confidence-interval type of divstats: ``ConfidenceInterval(low, high)``.

The shape of ``scipy.stats``' ``ConfidenceInterval`` (a named tuple of the two
ends), returned by every ``.confidence_interval()`` of divstats' results and held
by its interval records: ``low``/``high`` are floats for one quantity, arrays (or
``Parts`` of the gap decomposition) for several. A one-sided bound has an infinite
open end; a refused interval has NaN ends, with the reason on the record that
holds it.  In datasets intervals stay ``<name>_low`` / ``<name>_high`` variables
(the xarray form).  This is a base module: every room may import it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["ConfidenceInterval"]


class ConfidenceInterval(NamedTuple):
    """Lower and upper end of a confidence interval (scipy's shape).

    Examples
    --------
    >>> ci = ConfidenceInterval(0.1, 0.4)
    >>> ci.low, ci.high
    (0.1, 0.4)
    >>> low, high = ci
    """

    low: Any
    high: Any

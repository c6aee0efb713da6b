"""The exceptions divstats raises, all under one base :class:`DivstatsError`.

``except DivstatsError`` catches every refusal of divstats (a bad plan, an
output it will not overwrite). Classes that used to be plain ``ValueError``
subclasses still are, so existing ``except ValueError`` handlers keep working.
"""

from __future__ import annotations

__all__ = ["DivstatsError", "NotIdentified", "OutputError", "PlanError"]


class DivstatsError(Exception):
    """Base class of every exception divstats raises on purpose."""


class PlanError(DivstatsError, ValueError):
    """A plan that is ill-formed, or that does not fit the data it is run on."""


class NotIdentified(PlanError):
    """A hypothesis whose metric these traces cannot identify (short horizon or window).

    ``run_plan`` does not stop on it: the row is reported with NaN results and the
    reason in its ``note``, and the reason is added to the notes.
    """


class OutputError(DivstatsError, OSError):
    """An output path ``analyze`` refuses to write (exists, is a symlink, or is not its own)."""

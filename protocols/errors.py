"""The one error base of the ``protocols`` package.

Every exception that protocols raises on purpose derives from
:class:`ProtocolError`, so a caller can catch "anything wrong with a trace,
stream or policy id" in one clause. Each concrete class keeps ``ValueError`` as
a second base: code written before the base existed (``except ValueError``)
keeps working.

The concrete classes live next to the code that raises them:

==========================================  ===============================================
class                                       raised for
==========================================  ===============================================
:class:`protocols.validate.TraceValidationError`  a dataset that breaks the contract
:class:`protocols.assemble.StreamError`     a wire stream that is truncated, altered or failed
:class:`protocols.combine.CombineError`     datasets that cannot be combined
:class:`protocols.converters.ConversionError`  foreign input that cannot be converted
:class:`protocols.policies.PolicyIdError`   a policy id outside the grammar
==========================================  ===============================================
"""

from __future__ import annotations

__all__ = ["ConversionError", "ProtocolError"]


class ProtocolError(Exception):
    """Base of every error the ``protocols`` package raises on purpose.

    Examples
    --------
    >>> from protocols import ProtocolError, parse_policy_id
    >>> try:
    ...     parse_policy_id("snapkv@2")
    ... except ProtocolError as err:
    ...     print(type(err).__name__)
    PolicyIdError
    """


class ConversionError(ProtocolError, ValueError):
    """Input that cannot be converted; the message names the offending file and row.

    Raised by every converter (:mod:`protocols.converters`, :mod:`protocols.kvpress_results`,
    ``kvdiv convert``); defined here, below them all, so each can raise it.
    """

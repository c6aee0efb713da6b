"""The service's exceptions, under one base :class:`ServiceError`.

An :class:`ApiError` is what a client sees: TGI's error body ``{"error", "error_type"}``
with an HTTP status. Everything else under :class:`ServiceError` is raised inside the
server and mapped to an :class:`ApiError` (or a stream's error record) at the edge.
"""

from __future__ import annotations

__all__ = ["ServiceError", "ApiError", "ConfigError", "NonFiniteLogits", "RequestTimeout", "PolicyError",
           "RequestTooLarge", "Cancelled", "CandidateError", "invalid"]


class ServiceError(Exception):
    """Base of every exception raised by ``gen_service``."""


class ConfigError(ServiceError, ValueError):
    """A server configuration that must not start (e.g. an empty API key)."""


class AttentionRefused(ConfigError):
    """A model whose attention kvdiv's decoding path cannot reproduce (gen_service.attention.plan)."""


class RequestTimeout(ServiceError):
    """A request ran past ``--max-request-seconds``; its work was stopped."""


class NonFiniteLogits(ServiceError):
    """A forward gave NaN or inf logits: the request (or candidate) they belong to ends
    with an error record naming the step; its batch-mates go on
    (:class:`gen_service.engine.readback.FiniteGuard`).

    Parameters
    ----------
    step : str
        Where: ``"step 5"`` of a coupled, residual or reference loop, ``"branch step 2"``,
        ``"token 3"`` of a plain generation.
    side : str
        The side(s) whose logits were not finite (``"P"``, ``"Q"``, ``"P and Q"``).
    rows : int
        How many rows of that step were.
    of : int
        The step's rows.
    t : int, optional
        The loop's step number (None for a branch step or a generated token).
    """

    def __init__(self, step: str, side: str, rows: int, of: int, t: int | None = None):
        super().__init__(f"non-finite logits (NaN or inf) at {step} on {side}'s side in {rows} of {of} rows; "
                         "the request ends here")
        self.step, self.side, self.rows, self.of, self.t = step, side, rows, of, t


class PolicyError(ServiceError, ValueError):
    """A policy id the server cannot serve (unknown name, bad parameter...); the HTTP
    layer answers 422 before streaming. ``field`` names the offending part; ``permanent``
    marks a designed refusal of the press on this model (gen_service.presses.families):
    the same request can never succeed on this server, and the 422 says so."""

    def __init__(self, message: str, field: str | None = None, permanent: bool = False):
        super().__init__(message)
        self.field = field
        self.permanent = permanent


class RequestTooLarge(ServiceError, ValueError):
    """A request whose estimated memory exceeds the whole budget: it can never run."""


class Cancelled(ServiceError):
    """The client went away; work stops between steps."""


class CandidateError(ServiceError):
    """A candidate of a multi-candidate request failed before anything was streamed.

    Attributes
    ----------
    index : int
        Its position in ``candidates``.
    policy : str
        Its policy id.
    cause : BaseException
        What its prefill raised.
    """

    def __init__(self, index: int, policy: str, cause: BaseException):
        super().__init__(f"candidates[{index}] ({policy}): {type(cause).__name__}: {cause}")
        self.index, self.policy, self.cause = index, policy, cause


class ApiError(ServiceError):
    """An error answered as TGI does: ``{"error", "error_type"}`` with an HTTP status.

    Parameters
    ----------
    status : int
        The HTTP status (422 validation, 401, 408, 413, 424, 429, ...).
    message : str
        The human-readable error; for validation errors it starts with the field.
    error_type : str
        TGI's ``error_type`` (``validation``, ``overloaded``, ``generation``, ...).
    headers : dict, optional
        Extra response headers (``Retry-After`` on 429).
    permanent : bool
        A designed refusal (a press kvdiv refuses on this model): the body carries
        ``"permanent": true`` and a client must not retry the request.

    Examples
    --------
    >>> ApiError(429, "queue is full", "overloaded").body()
    {'error': 'queue is full', 'error_type': 'overloaded'}
    >>> ApiError(422, "candidate: refused", "validation", permanent=True).body()["permanent"]
    True
    """

    def __init__(self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None,
                 permanent: bool = False):
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type
        self.headers = dict(headers or {})
        self.permanent = permanent

    def body(self) -> dict[str, object]:
        """The JSON error body TGI's clients parse (plus ``permanent`` on a designed refusal)."""
        out: dict[str, object] = {"error": self.message, "error_type": self.error_type}
        if self.permanent:
            out["permanent"] = True
        return out


def invalid(field: str, why: str, permanent: bool = False) -> ApiError:
    """A 422 validation error whose message names the field first.

    Parameters
    ----------
    field : str
        The request field, as a path (``parameters.top_p``, ``messages[0].content``).
    why : str
        What is wrong with it.
    permanent : bool
        A designed refusal: no retry can succeed (:class:`ApiError`).

    Returns
    -------
    ApiError
        Status 422, ``error_type`` ``validation``.

    Raises
    ------
    None

    Examples
    --------
    >>> invalid("parameters.top_p", "must be in (0, 1]").message
    'parameters.top_p: must be in (0, 1]'
    """
    return ApiError(422, f"{field}: {why}", "validation", permanent=permanent)

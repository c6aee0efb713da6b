"""What one server accepts: the limits a request's body and fields are checked against.

``kvdiv serve``'s flags set them (:meth:`gen_service.serving.service.ServiceConfig.limits`,
``body_limits``); the API reads a body (:mod:`gen_service.api.body`) and parses its fields
(:mod:`gen_service.api.records`) against them. They live here, below both, so that the
service does not import the API.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_CANDIDATES", "RequestLimits", "BodyLimits"]

MAX_CANDIDATES = 64  # candidates in one /v1/traces request


@dataclass(frozen=True)
class RequestLimits:
    """What one server accepts (set by ``kvdiv serve`` flags)."""

    max_new_tokens: int = 1024
    max_replicates: int = 1024
    max_input_bytes: int = 1 << 20
    max_stop: int = 4
    max_top_n: int = 32
    default_eviction: str = "full"
    max_candidates: int = 64


class BodyLimits:
    """The body limits of one server (bytes, seconds, nesting depth).

    Parameters
    ----------
    max_bytes : int
        Largest body accepted (422 beyond it, as the spec and TGI answer).
    timeout_s : float
        Time allowed to receive the whole body (408 beyond it).
    max_depth : int
        Deepest nesting of arrays/objects accepted (422 beyond it).
    """

    def __init__(self, max_bytes: int = 1 << 20, timeout_s: float = 10.0, max_depth: int = 32):
        self.max_bytes, self.timeout_s, self.max_depth = max_bytes, timeout_s, max_depth

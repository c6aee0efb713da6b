"""Eviction policy ids: the grammar shared by traces, the service and the plans.

Grammar (docs/service.md)::

    full                       no eviction (the reference)
    <name>@<retention>         keep a fraction in (0, 1] of the prompt cache
    <name>#<budget>            keep a fixed number >= 1 of prompt tokens
    kvpress:<PressClass>@<r>   any kvpress press by class name
    <id>:<key>=<value>,...     press parameters on any id

This module only parses; which press implements a name is the service's business.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from protocols.errors import ProtocolError

__all__ = ["PolicyIdError", "PolicySpec", "parse_policy_id", "policy_coords"]

_ID = re.compile(
    r"^(?P<name>(?:kvpress:)?[A-Za-z_][A-Za-z0-9_.\-]*)"
    r"(?:(?P<sep>[@#])(?P<amount>[^:]+))?"
    r"(?::(?P<params>.+))?$"
)


class PolicyIdError(ProtocolError, ValueError):
    """A policy id that does not follow the grammar."""


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy id."""

    id: str
    name: str                      # e.g. "snapkv", "kvpress:TOVAPress", "full"
    retention: float = math.nan    # fraction of prompt tokens kept; NaN if budget-based
    budget: int = -1               # prompt tokens kept; -1 if ratio-based
    params: dict[str, object] = field(default_factory=dict)

    @property
    def is_full(self) -> bool:
        """True for the reference policy ``full`` (no eviction)."""
        return self.name == "full"


def _value(text: str) -> object:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def parse_policy_id(policy_id: str) -> PolicySpec:
    """Parse a policy id, raising :class:`PolicyIdError` naming what is wrong.

    Parameters
    ----------
    policy_id : str
        An id following the grammar in the module docstring.

    Returns
    -------
    PolicySpec
        Name, retention (NaN if budget-based), budget (-1 if ratio-based) and
        parameters; ``full`` has retention 1.

    Raises
    ------
    PolicyIdError
        The id does not follow the grammar; the message says which part.

    Examples
    --------
    >>> parse_policy_id("snapkv@0.5")
    PolicySpec(id='snapkv@0.5', name='snapkv', retention=0.5, budget=-1, params={})
    >>> parse_policy_id("streaming_llm#64:sink=4").params
    {'sink': 4}
    """
    m = _ID.match(policy_id.strip()) if isinstance(policy_id, str) else None
    if not m:
        raise PolicyIdError(f"policy id {policy_id!r} does not match <name>[@ratio|#budget][:k=v,...]")
    name, sep, amount, params_text = m["name"], m["sep"], m["amount"], m["params"]
    retention, budget = math.nan, -1
    if sep == "@":
        try:
            retention = float(amount)
        except ValueError:
            raise PolicyIdError(f"policy id {policy_id!r}: retention {amount!r} is not a number") from None
        if not 0.0 < retention <= 1.0:
            raise PolicyIdError(f"policy id {policy_id!r}: retention {retention} is outside (0, 1]")
    elif sep == "#":
        try:
            budget = int(amount)
        except ValueError:
            raise PolicyIdError(f"policy id {policy_id!r}: budget {amount!r} is not an integer") from None
        if budget < 1:
            raise PolicyIdError(f"policy id {policy_id!r}: budget {budget} is < 1")
    elif name != "full" and name != "candidate" and name.startswith("kvpress:"):
        raise PolicyIdError(f"policy id {policy_id!r}: kvpress presses need @<retention> or #<budget>")
    if name == "full" and sep:
        raise PolicyIdError(f"policy id {policy_id!r}: 'full' takes no retention or budget")
    if name == "full":
        retention = 1.0
    params: dict[str, object] = {}
    if params_text:
        for item in params_text.split(","):
            key, eq, val = item.partition("=")
            if not eq or not key.strip():
                raise PolicyIdError(f"policy id {policy_id!r}: parameter {item!r} is not key=value")
            params[key.strip()] = _value(val.strip())
    return PolicySpec(id=policy_id.strip(), name=name, retention=retention, budget=budget, params=params)


def policy_coords(policy_id: str) -> tuple[str, float, int]:
    """(press, retention, budget) coordinates for a policy id; lenient for foreign ids.

    Traces from other tools may use ids outside the grammar; they get press = id,
    retention NaN and budget -1 rather than an error.

    Parameters
    ----------
    policy_id : str
        Any policy id.

    Returns
    -------
    tuple of (str, float, int)
        The ``press``, ``retention`` and ``budget`` coordinates.

    Raises
    ------
    None
        Ids outside the grammar are accepted (see above).

    Examples
    --------
    >>> policy_coords("snapkv#512")
    ('snapkv', nan, 512)
    >>> policy_coords("my tool's policy")
    ("my tool's policy", nan, -1)
    """
    try:
        spec = parse_policy_id(policy_id)
    except PolicyIdError:
        return str(policy_id), math.nan, -1
    return spec.name, spec.retention, spec.budget

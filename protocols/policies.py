"""Eviction policy ids: the grammar shared by traces, the service and the plans.

Grammar (docs/contract.md, "Policy ids"; every press has an example in docs/service.md)::

    policy := "full" | press ["+" quant] | quant
    press  := term [":" params]
    quant  := "quant:" identifier "@" bits [":" params]   a quantized KV cache
    term   := name ["(" term {"," term} ")"] ["@" retention | "#" budget]
    name   := ["kvpress:"] identifier         a short alias (snapkv) or a press class
    params := key "=" value {"," key "=" value}
    key    := {hop "."} identifier            hop: an inner press's index or slot name

- ``@r`` keeps a fraction r in (0, 1] of the prompt cache; ``#b`` keeps b >= 1 tokens
  (b fits in int32: traces store it as int32).
- A wrapper takes its inner presses in parentheses:
  ``kvpress:AdaKVPress(SnapKVPress)@0.5``, ``kvpress:ComposedPress(SnapKVPress@0.5, ThinKPress@0.5)``,
  ``kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=64``.
- Values are integers, floats, ``true``/``false`` or bare words; ``;`` separates the
  items of a list value (``compression_ratios=0.2;0.6``).
- A *family* (a sweep: one method at several amounts) lists the outer amount's values,
  ``snapkv@0.9,0.7,0.5,0.3`` or ``snapkv#512,256,128``, or gives a range
  ``start..stop/step`` with both ends included, ``snapkv@0.9..0.3/0.2`` (0.9, 0.7, 0.5,
  0.3) or ``snapkv#512..128/128``; parameters and a quantizer follow as for one id
  (``snapkv@0.9,0.5:window_size=8``). :func:`expand_policy_family` turns it into its
  member ids, :func:`expand_policies` a comma-separated list of ids and families, and
  :func:`policy_families` groups ids back into families ordered by the KV they keep.
- ``quant:kivi@2`` quantizes the cache to 2 bits (KIVI); after a press,
  ``kvpress:SnapKVPress@0.5+quant:kivi@4:group_size=32`` compresses the prompt and
  quantizes what it keeps. The quantizer's own parameters follow its term; the press's
  end at ``+quant:``.

This module only parses; which press implements a name, and which parameters a
request may set, is the service's business.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from protocols.errors import ProtocolError

__all__ = ["PolicyIdError", "PolicySpec", "PressTerm", "QuantTerm", "parse_option_value", "parse_policy_id",
           "policy_coords", "MAX_POLICY_ID", "MAX_BUDGET", "MAX_FAMILY", "expand_policy_family", "expand_policies",
           "family_key", "policy_families"]

MAX_POLICY_ID = 1000            # characters; longer ids are refused before parsing
MAX_BUDGET = 2**31 - 1          # traces store budgets as int32
MAX_FAMILY = 64                 # members of one family (a longer sweep is a typo more often than a plan)
_NAME = re.compile(r"(?:kvpress:)?[A-Za-z_][A-Za-z0-9_.\-]*")
_KEY = re.compile(r"^(?:[A-Za-z0-9_]+\.)*[A-Za-z_][A-Za-z0-9_]*$")
_INT = re.compile(r"^[+-]?\d{1,18}$")
QUANT_PREFIX = "quant:"
_QUANT = re.compile(r"quant:([A-Za-z_][A-Za-z0-9_\-]*)@(\d{1,2})(?::(.*))?$", re.S)


class PolicyIdError(ProtocolError, ValueError):
    """A policy id that does not follow the grammar."""


@dataclass(frozen=True)
class PressTerm:
    """One press in a policy id: a name, its inner presses and its own amount."""

    name: str                              # e.g. "snapkv", "kvpress:AdaKVPress", "SnapKVPress"
    args: tuple[PressTerm, ...] = ()       # inner presses of a wrapper
    retention: float = math.nan            # from "@r"; NaN when absent
    budget: int = -1                       # from "#b"; -1 when absent

    @property
    def class_name(self) -> str:
        """The name without the ``kvpress:`` prefix (``SnapKVPress`` for ``kvpress:SnapKVPress``)."""
        return self.name.split(":", 1)[1] if self.name.startswith("kvpress:") else self.name

    @property
    def has_amount(self) -> bool:
        """True when the term carries its own ``@r`` or ``#b``."""
        return self.budget >= 1 or not math.isnan(self.retention)

    def text(self, amount: bool = True) -> str:
        """Canonical text (no spaces); without the outer amount when ``amount`` is False."""
        out = self.name + (f"({', '.join(a.text() for a in self.args)})" if self.args else "")
        if amount and self.budget >= 1:
            out += f"#{self.budget}"
        elif amount and not math.isnan(self.retention):
            out += f"@{self.retention:g}"
        return out


@dataclass(frozen=True)
class QuantTerm:
    """A quantized KV cache in a policy id: a method, its bit width and its parameters."""

    method: str                            # e.g. "kivi"
    bits: int                              # from "@b"
    params: dict[str, object] = field(default_factory=dict)

    def text(self) -> str:
        """Canonical text without parameters, e.g. ``quant:kivi@2``."""
        return f"{QUANT_PREFIX}{self.method}@{self.bits}"


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy id."""

    id: str
    name: str                      # the press expression without amount, e.g. "kvpress:AdaKVPress(SnapKVPress)"
    retention: float = math.nan    # fraction of prompt tokens kept; NaN if budget-based or none
    budget: int = -1               # prompt tokens kept; -1 if ratio-based or none
    params: dict[str, object] = field(default_factory=dict)
    press: PressTerm | None = None  # the parsed press tree; None for "full" and a quantizer alone
    quant: QuantTerm | None = None  # the cache's quantizer ("+quant:..." or "quant:..."); None when full precision

    @property
    def is_full(self) -> bool:
        """True for the reference policy ``full`` (no eviction)."""
        return self.name == "full"


def parse_option_value(text: str) -> int | float | bool | str:
    """A parameter value as policy ids spell it (``kvdiv serve --press-option`` reads its
    values the same way).

    Parameters
    ----------
    text : str
        The value's text, stripped.

    Returns
    -------
    int, float, bool or str
        An integer (up to 18 digits), a float (up to 40 characters), ``true``/``false``
        in any case, else the text itself.

    Raises
    ------
    None
        Any text is a value: what does not read as a number or a boolean is a string.

    Examples
    --------
    >>> [parse_option_value(v) for v in ("8", "0.5", "True", "models/q")]
    [8, 0.5, True, 'models/q']
    """
    if _INT.match(text):
        return int(text)
    if len(text) <= 40:
        try:
            return float(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


class _Parser:
    """Recursive descent over one policy id."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def fail(self, why: str) -> PolicyIdError:
        return PolicyIdError(f"policy id {self.text!r}: {why} at character {self.pos + 1}")

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_spaces(self) -> None:
        while self.peek() == " ":
            self.pos += 1

    def term(self, depth: int = 0) -> PressTerm:
        if depth > 8:
            raise self.fail("presses nested more than 8 deep")
        self.skip_spaces()
        m = _NAME.match(self.text, self.pos)
        if not m:
            raise self.fail("expected a press name")
        name, self.pos = m.group(), m.end()
        args: list[PressTerm] = []
        if self.peek() == "(":
            self.pos += 1
            args.append(self.term(depth + 1))
            while self.peek() == ",":
                self.pos += 1
                args.append(self.term(depth + 1))
            if self.peek() != ")":
                raise self.fail("expected ',' or ')'")
            self.pos += 1
        retention, budget = self.amount()
        self.skip_spaces()
        return PressTerm(name, tuple(args), retention, budget)

    def amount(self) -> tuple[float, int]:
        sep = self.peek()
        if sep not in ("@", "#"):
            return math.nan, -1
        self.pos += 1
        m = re.compile(r"[^:,()\s]+").match(self.text, self.pos)
        if not m:
            raise self.fail(f"expected a number after {sep!r}")
        amount, self.pos = m.group(), m.end()
        if sep == "@":
            try:
                retention = float(amount)
            except ValueError:
                raise self.fail(f"retention {amount!r} is not a number") from None
            if not 0.0 < retention <= 1.0:
                raise self.fail(f"retention {amount} is outside (0, 1]")
            return retention, -1
        if not _INT.match(amount):
            raise self.fail(f"budget {amount!r} is not an integer")
        budget = int(amount)
        if not 1 <= budget <= MAX_BUDGET:
            raise self.fail(f"budget {budget} is outside [1, {MAX_BUDGET}]")
        return math.nan, budget


def _params(policy_id: str, text: str) -> dict[str, object]:
    params: dict[str, object] = {}
    for item in text.split(","):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or not _KEY.match(key):
            raise PolicyIdError(f"policy id {policy_id!r}: parameter {item.strip()!r} is not key=value")
        if key in params:
            raise PolicyIdError(f"policy id {policy_id!r}: parameter {key!r} is given twice")
        params[key] = parse_option_value(val.strip())
    return params


def parse_policy_id(policy_id: str) -> PolicySpec:
    """Parse a policy id.

    Parameters
    ----------
    policy_id : str
        e.g. ``"snapkv@0.5"``, ``"kvpress:AdaKVPress(SnapKVPress)@0.5:alpha_safeguard=0.1"``,
        ``"quant:kivi@2"``, ``"snapkv@0.5+quant:kivi@4"``.

    Returns
    -------
    PolicySpec
        The id, the press expression as ``name`` (with ``+quant:<method>@<bits>``
        when quantized), the outer amount and parameters, the press tree as
        ``press`` and the quantizer as ``quant``.

    Raises
    ------
    PolicyIdError
        When the id does not follow the grammar; the message names what is wrong.

    Examples
    --------
    >>> spec = parse_policy_id("snapkv@0.5")
    >>> spec.name, spec.retention, spec.budget, spec.params
    ('snapkv', 0.5, -1, {})
    >>> spec = parse_policy_id("kvpress:ChunkKVPress(SnapKVPress)@0.5:chunk_length=8")
    >>> spec.name, spec.retention, spec.params, spec.press.args[0].name
    ('kvpress:ChunkKVPress(SnapKVPress)', 0.5, {'chunk_length': 8}, 'SnapKVPress')
    >>> spec = parse_policy_id("snapkv@0.5+quant:kivi@4:residual_length=32")
    >>> spec.name, spec.retention, spec.quant
    ('snapkv+quant:kivi@4', 0.5, QuantTerm(method='kivi', bits=4, params={'residual_length': 32}))
    """
    if not isinstance(policy_id, str):
        raise PolicyIdError(f"policy id must be a string, not {type(policy_id).__name__}")
    text = policy_id.strip()
    if len(text) > MAX_POLICY_ID:
        raise PolicyIdError(f"policy id of {len(text)} characters is longer than {MAX_POLICY_ID}")
    if text == "full":
        return PolicySpec(id=text, name="full", retention=1.0)
    if text.startswith(QUANT_PREFIX):
        quant = _quant(text, text)
        return PolicySpec(id=text, name=quant.text(), quant=quant)
    press_text, sep, quant_text = text.partition("+" + QUANT_PREFIX)
    quant = _quant(text, QUANT_PREFIX + quant_text) if sep else None
    parser = _Parser(press_text)
    term = parser.term()
    params: dict[str, object] = {}
    if parser.peek() == ":":
        params = _params(text, press_text[parser.pos + 1:])
    elif parser.peek():
        raise parser.fail(f"unexpected {parser.peek()!r}")
    if term.name == "full":
        raise PolicyIdError(f"policy id {text!r}: 'full' takes no retention, budget, inner press, parameters or "
                            f"quantizer (a quantized cache alone is 'quant:<method>@<bits>')")
    name = term.text(amount=False) + ("" if quant is None else "+" + quant.text())
    return PolicySpec(id=text, name=name, retention=term.retention, budget=term.budget,
                      params=params, press=term, quant=quant)


def _quant(policy_id: str, text: str) -> QuantTerm:
    """``quant:<method>@<bits>[:params]`` -> a :class:`QuantTerm`."""
    m = _QUANT.match(text)
    if not m:
        raise PolicyIdError(f"policy id {policy_id!r}: {text!r} is not quant:<method>@<bits>[:key=value,...] "
                            f"(e.g. quant:kivi@2)")
    method, bits, rest = m.group(1), int(m.group(2)), m.group(3)
    return QuantTerm(method, bits, {} if rest is None else _params(policy_id, rest))


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
    >>> policy_coords("kvpress:AdaKVPress(SnapKVPress)@0.5")
    ('kvpress:AdaKVPress(SnapKVPress)', 0.5, -1)
    >>> policy_coords("my tool's policy")
    ("my tool's policy", nan, -1)
    """
    try:
        spec = parse_policy_id(policy_id)
    except PolicyIdError:
        return str(policy_id), math.nan, -1
    return spec.name, spec.retention, spec.budget


# ---------------------------------------------------------------------------------------------
# Families: one method at several amounts (a sweep)

_RANGE = re.compile(r"^([^.]+(?:\.\d*)?)\.\.([^/]+)/(.+)$")


def _outer_amount(policy_id: str, press_text: str) -> tuple[int, int]:
    """(start, end) of the outer term's amount text in ``press_text``, after its ``@``/``#``; (-1, -1) if none.

    The outer term is the name and its balanced parentheses; its amount runs to the
    first ``:`` (parameters) or the end.
    """
    m = _NAME.match(press_text.lstrip(" "))
    if not m:
        raise PolicyIdError(f"policy id {policy_id!r}: expected a press name at character 1")
    pos = len(press_text) - len(press_text.lstrip(" ")) + m.end()
    if pos < len(press_text) and press_text[pos] == "(":
        depth = 0
        for i in range(pos, len(press_text)):
            depth += {"(": 1, ")": -1}.get(press_text[i], 0)
            if depth == 0:
                pos = i + 1
                break
        else:
            raise PolicyIdError(f"policy id {policy_id!r}: unbalanced '('")
    if pos >= len(press_text) or press_text[pos] not in "@#":
        return -1, -1
    end = press_text.find(":", pos)
    return pos + 1, len(press_text) if end < 0 else end


def _family_values(policy_id: str, sep: str, text: str) -> list[str]:
    """The amounts a family's amount text lists (``a,b,c`` or ``start..stop/step``), as text."""
    m = _RANGE.match(text)
    if not m:
        values = [v.strip() for v in text.split(",")]
        if any(not v for v in values):
            raise PolicyIdError(f"policy id {policy_id!r}: empty amount in the list {sep}{text!r}")
        return values
    try:
        start, stop, step = (float(x) for x in m.groups())
    except ValueError:
        raise PolicyIdError(f"policy id {policy_id!r}: range {sep}{text} is not start..stop/step "
                            f"with numbers (e.g. snapkv@0.9..0.3/0.2)") from None
    if not (math.isfinite(step) and step > 0):
        raise PolicyIdError(f"policy id {policy_id!r}: range step {m.group(3)} must be > 0 (the direction is "
                            f"start -> stop)")
    span = abs(stop - start)
    count = round(span / step)
    if abs(count * step - span) > 1e-9 * max(1.0, span):
        raise PolicyIdError(f"policy id {policy_id!r}: range {sep}{text}: step {step:g} does not reach "
                            f"{stop:g} from {start:g} in whole steps")
    if count + 1 > MAX_FAMILY:
        raise PolicyIdError(f"policy id {policy_id!r}: range {sep}{text} has {count + 1} members, more than "
                            f"{MAX_FAMILY}")
    sign = 1.0 if stop >= start else -1.0
    points = [start + sign * k * step for k in range(count + 1)]
    if sep == "#":
        if any(abs(p - round(p)) > 1e-9 for p in points):
            raise PolicyIdError(f"policy id {policy_id!r}: budget range {sep}{text} must be whole tokens")
        return [str(int(round(p))) for p in points]
    return [f"{round(p, 10):g}" for p in points]


def expand_policy_family(policy_id: str) -> tuple[str, ...]:
    """The member ids of a policy family (a one-member tuple for a plain id).

    Parameters
    ----------
    policy_id : str
        A policy id whose outer amount may list several values (``snapkv@0.9,0.5``,
        ``snapkv#512,128``) or a range with both ends included (``snapkv@0.9..0.3/0.2``,
        ``snapkv#512..128/128``); parameters and a quantizer apply to every member.

    Returns
    -------
    tuple of str
        Each member's id, in the order written; every one is checked by
        :func:`parse_policy_id`.

    Raises
    ------
    PolicyIdError
        For an ill-formed list or range, a member outside the grammar (e.g. a
        retention outside (0, 1]), a repeated member or more than :data:`MAX_FAMILY`.

    Examples
    --------
    >>> expand_policy_family("snapkv@0.9,0.7,0.5")
    ('snapkv@0.9', 'snapkv@0.7', 'snapkv@0.5')
    >>> expand_policy_family("snapkv@0.9..0.3/0.2")
    ('snapkv@0.9', 'snapkv@0.7', 'snapkv@0.5', 'snapkv@0.3')
    >>> expand_policy_family("snapkv#512..128/128:window_size=8")
    ('snapkv#512:window_size=8', 'snapkv#384:window_size=8', 'snapkv#256:window_size=8', 'snapkv#128:window_size=8')
    >>> expand_policy_family("recent@0.5")
    ('recent@0.5',)
    """
    if not isinstance(policy_id, str):
        raise PolicyIdError(f"policy id must be a string, not {type(policy_id).__name__}")
    text = policy_id.strip()
    if text == "full" or text.startswith(QUANT_PREFIX):
        return (parse_policy_id(text).id,)
    press_text, plus, quant_text = text.partition("+" + QUANT_PREFIX)
    start, end = _outer_amount(text, press_text)
    amount = press_text[start:end] if start >= 0 else ""
    if start < 0 or ("," not in amount and ".." not in amount):
        return (parse_policy_id(text).id,)
    sep = press_text[start - 1]
    values = _family_values(text, sep, amount)
    if len(values) > MAX_FAMILY:
        raise PolicyIdError(f"policy id {text!r}: {len(values)} members, more than {MAX_FAMILY}")
    head, tail = press_text[:start], press_text[end:] + plus + quant_text
    members = tuple(parse_policy_id(head + v + tail).id for v in values)
    keys = [_amount_of(parse_policy_id(m)) for m in members]
    if len(set(keys)) != len(keys):
        raise PolicyIdError(f"policy id {text!r}: the family repeats an amount ({', '.join(values)})")
    return members


def _amount_of(spec: PolicySpec) -> float:
    return float(spec.budget) if spec.budget >= 1 else spec.retention


def expand_policies(value: str | list[str] | tuple[str, ...]) -> list[str]:
    """Policy ids from a comma-separated list of ids and families (``kvdiv collect --policies``).

    Commas separate ids, a family's amounts (``snapkv@0.9,0.7``) and an id's parameters
    (``snapkv@0.5:window_size=64,n_sink=0``): a piece that starts with a digit or ``.``
    continues the family before it (while its parameters have not started), a
    ``key=value`` piece the parameters before it; anything else starts a new id.

    Parameters
    ----------
    value : str or sequence of str
        The list as one string, or already split (each item may itself be a family).

    Returns
    -------
    list of str
        Every member id, families expanded in place.

    Raises
    ------
    PolicyIdError
        For any ill-formed id or family.

    Examples
    --------
    >>> expand_policies("snapkv@0.9,0.5,recent@0.9..0.5/0.4,snapkv#128")
    ['snapkv@0.9', 'snapkv@0.5', 'recent@0.9', 'recent@0.5', 'snapkv#128']
    >>> expand_policies("snapkv@0.5:window_size=64,n_sink=0, recent@0.5")
    ['snapkv@0.5:window_size=64,n_sink=0', 'recent@0.5']
    """
    items = [value] if isinstance(value, str) else list(value)
    ids: list[str] = []
    for item in items:
        for piece in (p.strip() for p in item.split(",")):
            if not piece:
                continue
            if ids and piece[0] in "0123456789." and ":" not in _press_part(ids[-1]):
                ids[-1] += "," + piece
            elif ids and "=" in piece and ":" not in piece and "@" not in piece and "#" not in piece:
                ids[-1] += "," + piece
            else:
                ids.append(piece)
    return [member for text in ids for member in expand_policy_family(text)]


def _press_part(policy_id: str) -> str:
    return policy_id.partition("+" + QUANT_PREFIX)[0]


def family_key(policy_id: str) -> str:
    """The family a policy id belongs to: its press expression, the kind of amount and its parameters.

    ``snapkv@0.5`` and ``snapkv@0.3`` are ``snapkv@*``; ``snapkv#128`` is ``snapkv#*``;
    parameters (canonical, sorted) are part of the key (``snapkv@*:window_size=8``).
    "" for ids that belong to no family: ``full``, a quantizer alone, a press without
    an amount, and ids outside the grammar.

    Parameters
    ----------
    policy_id : str
        A policy id (docs/contract.md grammar) or any other text.

    Returns
    -------
    str
        The family key (``snapkv@*``, ``snapkv#*``, with parameters and quantizer), or ""
        when the id belongs to no family.

    Raises
    ------
    None
        Ids outside the grammar are accepted: they belong to no family ("").

    Examples
    --------
    >>> family_key("snapkv@0.5"), family_key("snapkv#128"), family_key("full")
    ('snapkv@*', 'snapkv#*', '')
    >>> family_key("kvpress:AdaKVPress(SnapKVPress)@0.5:alpha_safeguard=0.1")
    'kvpress:AdaKVPress(SnapKVPress)@*:alpha_safeguard=0.1'
    """
    try:
        spec = parse_policy_id(policy_id)
    except PolicyIdError:
        return ""
    if spec.press is None or spec.is_full or (spec.budget < 1 and math.isnan(spec.retention)):
        return ""
    press, _, quant = spec.name.partition("+")
    params = ",".join(f"{k}={v}" for k, v in sorted(spec.params.items()))
    return (press + ("#*" if spec.budget >= 1 else "@*") + (f":{params}" if params else "")
            + (f"+{quant}" if quant else ""))


def policy_families(policy_ids, *, kept=None, min_members: int = 1) -> dict[str, tuple[str, ...]]:
    """Group policy ids into families, each ordered from the most to the least KV kept.

    Parameters
    ----------
    policy_ids : iterable of str
        Policy ids (e.g. a dataset's ``policy`` coordinate); ids in no family are left out.
    kept : mapping of str to float, optional
        The KV each id keeps, to order by (e.g. the achieved retention a trace header
        records); default the nominal amount: the retention, or the budget in tokens.
    min_members : int
        Families with fewer members are left out (2 for a curve).

    Returns
    -------
    dict of str to tuple of str
        :func:`family_key` -> member ids, most KV kept first (ties: in the order given).

    Raises
    ------
    None
        Ids outside the grammar belong to no family and are left out; a non-finite
        ``kept`` value falls back to the nominal amount.

    Examples
    --------
    >>> policy_families(["full", "snapkv@0.3", "recent@0.5", "snapkv@0.9", "snapkv#64", "snapkv#128"])
    {'snapkv@*': ('snapkv@0.9', 'snapkv@0.3'), 'recent@*': ('recent@0.5',), 'snapkv#*': ('snapkv#128', 'snapkv#64')}
    """
    groups: dict[str, list[str]] = {}
    for pid in policy_ids:
        key = family_key(str(pid))
        if key:
            groups.setdefault(key, []).append(str(pid))
    def amount(pid: str) -> float:
        if kept is not None and pid in kept and math.isfinite(float(kept[pid])):
            return float(kept[pid])
        return _amount_of(parse_policy_id(pid))
    return {key: tuple(sorted(ids, key=amount, reverse=True)) for key, ids in groups.items()
            if len(ids) >= min_members}

"""Prespecified analysis plans (docs/statistics.md §8): the format, its validation, the split.

A plan is a TOML file written before the data are looked at. It fixes the
document split (a salted hash of the document id), the early/late age windows and
every hypothesis: metric, the two things compared, direction, test, family and
correction. :func:`load_plan` reads and validates one (a file, TOML text, a dict,
or the name of a plan shipped with divstats, e.g. ``"paper"``) and returns a frozen
:class:`Plan`; :func:`assign_split` gives the document split it fixes. Running a
plan on traces is :func:`divstats.plans.run.run_plan`. The format is documented in
``docs/plans.md``.

The shipped plans are package data (``divstats/shipped_plans/*.toml``), read with
:mod:`importlib.resources`, so a wheel install has them too.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import pandas as pd

from divstats.errors import PlanError
from divstats.estimands import ANSWER_ESTIMANDS, by_name
from divstats.estimation.speculative import SPECULATIVE_METRICS
from divstats.inference.choices import ALTERNATIVES, MARGIN_ALTERNATIVES, MARGIN_TESTS, TESTS, WORSE
from protocols.policies import PolicyIdError, expand_policy_family

__all__ = [
    "CORRECTIONS", "FULL", "SPLITS", "WINDOW_METRICS", "Certification", "Hypothesis", "Plan", "PlanError", "PlanSource",
    "assign_split", "load_plan", "parse_aliases", "shipped_plan", "shipped_plans", "split_disagreement_note",
    "split_table", "split_uniform",
]

#: The answer metrics a plan may test or certify (docs/statistics.md §12), with the side that is worse.
ANSWER_METRICS: dict[str, str] = {e.name: e.worse for e in ANSWER_ESTIMANDS}

SPLITS: tuple[str, ...] = ("confirmatory", "exploratory", "all")
CORRECTIONS: tuple[str, ...] = ("holm", "none")
WINDOW_METRICS: tuple[str, ...] = ("branch_tv",)
#: The full-cache model as side B of ``compare`` (tests at a margin against the full model):
#: a policy of this name in the data (a measured control) or else the full model's known value.
FULL = "full"

_PLAN_KEYS = {"name", "description", "alpha", "salt", "confirmatory_fraction"}
_HYP_KEYS = {"id", "family", "metric", "compare", "policy", "window", "direction", "test",
             "correction", "split", "alpha", "model", "description", "margin", "worse", "gamma"}
_CERT_KEYS = {"id", "family", "metric", "margin", "worse", "alpha", "split", "reference", "model", "test",
              "description"}
_TOP_KEYS = {"plan", "windows", "aliases", "hypothesis", "certify"}
#: Where the shipped plans live inside the divstats package.
_SHIPPED_DIR = "shipped_plans"


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Hypothesis:
    """One prespecified paired comparison; the effect is A − B."""

    id: str
    family: str
    metric: str
    compare: tuple[str, str]
    direction: str = "two-sided"
    test: str = "wilcoxon"
    correction: str = "holm"
    split: str = "confirmatory"
    policy: str | None = None   # set when comparing two windows of one policy
    window: str | None = None   # set when comparing two policies on a windowed metric
    alpha: float = 0.05
    model: str | None = None    # restrict to one model; default: each model separately
    description: str = ""
    margin: float | None = None  # direction "equivalence" / "noninferiority": delta (> 0)
    worse: str = "larger"        # which direction of A - B is worse (default: the estimand table's)
    gamma: int | None = None     # drafts per call, for the speculative-decoding metrics (docs/statistics.md §10)

    @property
    def compares_windows(self) -> bool:
        return self.policy is not None


@dataclass(frozen=True)
class Certification:
    """One prespecified ``[[certify]]``: the smallest budget of a policy family non-inferior at a margin.

    Run by ``divstats.certify_family`` (fixed-sequence tests from the most to the least KV
    kept; docs/statistics.md §11): its own familywise error is controlled at ``alpha``
    without Holm, so it is in no ``family`` of hypotheses.
    """

    id: str
    family: str                  # the policy family: "snapkv", "snapkv@*", "snapkv@0.9,0.7,0.5"
    metric: str                  # an estimand of divstats.ESTIMANDS
    margin: float                # delta > 0 (the worse side's sign is accepted and dropped)
    worse: str = "larger"        # default: the estimand table's
    alpha: float = 0.05
    split: str = "confirmatory"
    reference: str | float = FULL  # "full": the measured control, else the full model's known value; or a number
    model: str | None = None
    test: str = "bootstrap-t"
    description: str = ""


@dataclass(frozen=True)
class Plan:
    """A validated plan. ``sha256`` identifies the exact plan text (or canonical JSON)."""

    name: str
    alpha: float
    salt: str
    confirmatory_fraction: float
    windows: dict[str, tuple[int, int]]
    hypotheses: tuple[Hypothesis, ...]
    aliases: dict[str, str] = field(default_factory=dict)
    description: str = ""
    sha256: str = ""
    source: str = ""
    certifications: tuple[Certification, ...] = ()

    def families(self) -> dict[str, list[Hypothesis]]:
        out: dict[str, list[Hypothesis]] = {}
        for h in self.hypotheses:
            out.setdefault(h.family, []).append(h)
        return out

    def policies(self) -> set[str]:
        """Policy ids named by the plan (before aliases)."""
        out: set[str] = set()
        for h in self.hypotheses:
            out.update([h.policy] if h.compares_windows else h.compare)
        return out


#: Everything :func:`load_plan` accepts.
PlanSource = Plan | str | Path | Traversable | Mapping[str, Any]


# ---------------------------------------------------------------------------
# Shipped plans (package data)
# ---------------------------------------------------------------------------

def shipped_plans() -> list[str]:
    """Names of the plans shipped with divstats (``--plan NAME``).

    Returns
    -------
    list of str
        Sorted plan names (file names without ``.toml``).

    Examples
    --------
    >>> "paper" in shipped_plans()
    True
    """
    folder = resources.files("divstats").joinpath(_SHIPPED_DIR)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def shipped_plan(name: str = "paper") -> Traversable:
    """The shipped plan file ``name`` (read it with ``.read_text()`` or :func:`load_plan`).

    Parameters
    ----------
    name : str
        A name from :func:`shipped_plans`.

    Returns
    -------
    importlib.resources.abc.Traversable
        The file inside the installed package (a :class:`pathlib.Path` for an
        ordinary install).

    Raises
    ------
    PlanError
        If no plan of that name is shipped.

    Examples
    --------
    >>> shipped_plan("paper").name
    'paper.toml'
    """
    if name not in shipped_plans():
        raise PlanError(f"no shipped plan named {name!r}; shipped: {shipped_plans()}")
    return resources.files("divstats").joinpath(_SHIPPED_DIR, f"{name}.toml")


# ---------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------

def _canonical_json(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str).encode("utf-8")


def load_plan(source: PlanSource) -> Plan:
    """Read and validate a plan.

    Parameters
    ----------
    source : Plan, str, pathlib.Path, Traversable or mapping
        A TOML file, TOML text, a dict with the TOML's structure, or the name of a
        shipped plan (``"paper"``; see :func:`shipped_plans`). A bare shipped name
        means the shipped plan even if a file of that name exists in the working
        directory (write ``./paper`` for the file). A :class:`Plan` is returned as is.

    Returns
    -------
    Plan
        The validated plan; ``sha256`` is of the file's bytes, or of canonical JSON
        (sorted keys, compact) for a dict; ``source`` says where it came from
        (the shipped name for a shipped plan).

    Raises
    ------
    PlanError
        Listing every problem found, or naming the file that does not exist.

    Examples
    --------
    >>> plan = load_plan("paper")
    >>> plan.name, plan.source
    ('kvdiv-paper', 'paper')
    """
    if isinstance(source, Plan):
        return source
    if isinstance(source, Mapping):
        raw, digest, where = dict(source), hashlib.sha256(_canonical_json(source)).hexdigest(), "<dict>"
    else:
        text_bytes, where = _read_source(source)
        digest = hashlib.sha256(text_bytes).hexdigest()
        try:
            raw = tomllib.loads(text_bytes.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise PlanError(f"plan {where}: not valid TOML: {exc}") from None
    problems: list[str] = []
    plan = _validate(raw, problems)
    if problems:
        raise PlanError(f"plan {where} is ill-formed:\n  - " + "\n  - ".join(problems))
    assert plan is not None
    return Plan(**{**plan.__dict__, "sha256": digest, "source": where})


def _read_source(source: str | Path | Traversable) -> tuple[bytes, str]:
    """(bytes, where) for a shipped name, a file, or TOML text."""
    if isinstance(source, str) and source in shipped_plans():
        return shipped_plan(source).read_bytes(), source
    if isinstance(source, str) and ("[plan]" in source or "\n" in source):
        return source.encode("utf-8"), "<text>"
    path = Path(source) if isinstance(source, (str, Path)) else source
    if path.is_file():
        return path.read_bytes(), str(path)
    raise PlanError(f"plan file {str(source)!r} does not exist (shipped plans: {shipped_plans()})")


def _validate(raw: dict[str, Any], problems: list[str]) -> Plan | None:
    for key in sorted(set(raw) - _TOP_KEYS):
        problems.append(f"unknown top-level table {key!r} (expected {sorted(_TOP_KEYS)})")
    head = raw.get("plan")
    if not isinstance(head, Mapping):
        problems.append("missing [plan] table (name, alpha, salt, confirmatory_fraction)")
        head = {}
    name, alpha, salt, fraction = _validate_head(head, problems)
    windows = _validate_windows(raw.get("windows", {}), problems)
    aliases = _validate_aliases(raw.get("aliases", {}), problems)
    certs = _validate_certifications(raw.get("certify", []), alpha, problems)
    hyps = (_validate_hypotheses(raw.get("hypothesis"), windows, alpha, problems)
            if "hypothesis" in raw or not certs else [])
    ids = [h.id for h in hyps] + [c.id for c in certs]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"id {dup!r} is used by a [[hypothesis]] and a [[certify]]")
    if problems:
        return None
    return Plan(name=name, alpha=alpha, salt=salt, confirmatory_fraction=fraction,
                windows=windows, hypotheses=tuple(hyps), aliases=aliases,
                description=str(head.get("description", "")), certifications=tuple(certs))


def _validate_certifications(raw: Any, alpha: float, problems: list[str]) -> list[Certification]:
    """The ``[[certify]]`` tables (problems appended, each naming its table)."""
    if not isinstance(raw, list):
        problems.append("[[certify]] must be an array of tables")
        return []
    out: list[Certification] = []
    seen: set[str] = set()
    for i, c in enumerate(raw, start=1):
        where = f"[[certify]] #{i}" + (f" ({c.get('id')!r})" if isinstance(c, Mapping) and "id" in c else "")
        if not isinstance(c, Mapping):
            problems.append(f"{where}: must be a table")
            continue
        found: list[str] = []
        cert = _validate_certification(c, where, alpha, seen, found)
        problems.extend(found)
        if cert is not None and not found:
            out.append(cert)
    return out


def _metric_problems(metric: Any, where: str) -> list[str]:
    """A certification's metric must be a row of the estimand table or of the answers' table."""
    if metric in ANSWER_METRICS:
        return []
    try:
        by_name(str(metric))
    except KeyError:
        return [f"{where}: 'metric' must be an estimand of divstats.ESTIMANDS or ANSWER_ESTIMANDS, got {metric!r}"]
    return []


def _validate_certification(c: Mapping[str, Any], where: str, alpha: float, seen: set[str],
                            found: list[str]) -> Certification | None:
    """One [[certify]] table: its problems appended to ``found``; the Certification if none."""
    for key in sorted(set(c) - _CERT_KEYS):
        found.append(f"{where}: unknown key {key!r} (expected {sorted(_CERT_KEYS)})")
    for key in ("id", "family", "metric"):
        if not isinstance(c.get(key), str) or not c.get(key):
            found.append(f"{where}: {key!r} must be a non-empty string")
    if isinstance(c.get("id"), str):
        if c["id"] in seen:
            found.append(f"{where}: duplicate id {c['id']!r}")
        seen.add(c["id"])
    found.extend(_metric_problems(c.get("metric"), where))
    if isinstance(c.get("family"), str):
        found.extend(f"{where}: {p}" for p in _family_problems(c["family"]))
    margin, worse = _check_margin({**c, "direction": "noninferiority", "test": c.get("test", "bootstrap-t")},
                                  None, where, found)
    _check_choice(c, "test", MARGIN_TESTS, "bootstrap-t", where, found)
    _check_choice(c, "split", SPLITS, "confirmatory", where, found)
    c_alpha = c.get("alpha", alpha)
    if not _is_number(c_alpha) or not 0 < c_alpha < 1:
        found.append(f"{where}: 'alpha' must be in (0, 1), got {c_alpha!r}")
    reference = c.get("reference", FULL)
    if reference != FULL and not (_is_number(reference) and math.isfinite(reference)):
        found.append(f"{where}: 'reference' must be {FULL!r} or a number, got {reference!r}")
    model = c.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        found.append(f"{where}: 'model' must be a model name")
    if found or margin is None:
        return None
    return Certification(id=c["id"], family=c["family"], metric=c["metric"], margin=margin, worse=worse,
                         alpha=float(c_alpha), split=c.get("split", "confirmatory"),
                         reference=reference if reference == FULL else float(reference), model=model,
                         test=c.get("test", "bootstrap-t"), description=str(c.get("description", "")))


def _family_problems(family: str) -> list[str]:
    """A certify's ``family``: a bare press name, a family key (``snapkv@*``) or a family written out."""
    if "@" not in family and "#" not in family:
        return []
    if family.endswith(("@*", "#*")) or "@*:" in family or "#*:" in family:
        return []
    try:
        members = expand_policy_family(family)
    except PolicyIdError as exc:
        return [f"'family': {exc}"]
    if len(members) < 2:
        return [f"'family' {family!r} has one member; a family lists several amounts "
                f"(e.g. {family.split('@')[0]}@0.9,0.7,0.5 or a bare name such as 'snapkv')"]
    return []


def _validate_head(head: Mapping[str, Any], problems: list[str]) -> tuple[Any, float, Any, float]:
    """(name, alpha, salt, confirmatory_fraction) of the [plan] table; defaults where invalid."""
    for key in sorted(set(head) - _PLAN_KEYS):
        problems.append(f"[plan]: unknown key {key!r} (expected {sorted(_PLAN_KEYS)})")
    name = head.get("name")
    if not isinstance(name, str) or not name.strip():
        problems.append("[plan]: 'name' must be a non-empty string")
    alpha = head.get("alpha", 0.05)
    if not _is_number(alpha) or not 0 < alpha < 1:
        problems.append(f"[plan]: 'alpha' must be a number in (0, 1), got {alpha!r}")
        alpha = 0.05
    salt = head.get("salt")
    if not isinstance(salt, str) or not salt:
        problems.append("[plan]: 'salt' must be a non-empty string (it fixes the document split)")
    fraction = head.get("confirmatory_fraction", 0.5)
    if not _is_number(fraction) or not 0 < fraction <= 1:
        problems.append(f"[plan]: 'confirmatory_fraction' must be in (0, 1], got {fraction!r}")
        fraction = 0.5
    return name, float(alpha), salt, float(fraction)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _validate_windows(raw: Any, problems: list[str]) -> dict[str, tuple[int, int]]:
    if not isinstance(raw, Mapping):
        problems.append("[windows] must be a table of name = [first_age, last_age]")
        return {}
    out: dict[str, tuple[int, int]] = {}
    for name, rng in raw.items():
        ok = (isinstance(rng, list) and len(rng) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in rng))
        if not ok:
            problems.append(f"[windows]: {name!r} must be [first_age, last_age] (two integers), got {rng!r}")
        elif rng[0] < 0 or rng[1] < rng[0]:
            problems.append(f"[windows]: {name!r} = {rng} needs 0 <= first_age <= last_age")
        else:
            out[name] = (int(rng[0]), int(rng[1]))
    return out


def _validate_aliases(raw: Any, problems: list[str]) -> dict[str, str]:
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v
                                              for k, v in raw.items()):
        problems.append('[aliases] must map planned policy ids to data policy ids: "snapkv#512" = "snapkv#128"')
        return {}
    return dict(raw)


def _validate_hypotheses(raw: Any, windows: Mapping[str, tuple[int, int]], alpha: float,
                         problems: list[str]) -> list[Hypothesis]:
    if not isinstance(raw, list) or not raw:
        problems.append("no [[hypothesis]] entries")
        return []
    hyps: list[Hypothesis] = []
    seen: set[str] = set()
    for i, h in enumerate(raw, start=1):
        where = f"[[hypothesis]] #{i}" + (f" ({h.get('id')!r})" if isinstance(h, Mapping) and "id" in h else "")
        if not isinstance(h, Mapping):
            problems.append(f"{where}: must be a table")
            continue
        found: list[str] = []
        hyp = _validate_hypothesis(h, where, windows, alpha, seen, found)
        problems.extend(found)
        if hyp is not None and not found:
            hyps.append(hyp)
    _check_families(hyps, problems)
    return hyps


def _validate_hypothesis(h: Mapping[str, Any], where: str, windows: Mapping[str, tuple[int, int]], alpha: float,
                         seen: set[str], problems: list[str]) -> Hypothesis | None:
    """One [[hypothesis]] table: its problems appended to ``problems``; the Hypothesis if none."""
    for key in sorted(set(h) - _HYP_KEYS):
        problems.append(f"{where}: unknown key {key!r} (expected {sorted(_HYP_KEYS)})")
    for key in ("id", "family", "metric"):
        if not isinstance(h.get(key), str) or not h.get(key):
            problems.append(f"{where}: {key!r} must be a non-empty string")
    if isinstance(h.get("id"), str):
        if h["id"] in seen:
            problems.append(f"{where}: duplicate id {h['id']!r}")
        seen.add(h["id"])
    compare = _validate_compare(h.get("compare"), where, problems)
    _check_choice(h, "direction", ALTERNATIVES + MARGIN_ALTERNATIVES, "two-sided", where, problems)
    margin, worse = _check_margin(h, compare, where, problems)
    _check_choice(h, "test", TESTS, "wilcoxon", where, problems)
    _check_choice(h, "correction", CORRECTIONS, "holm", where, problems)
    _check_choice(h, "split", SPLITS, "confirmatory", where, problems)
    h_alpha = h.get("alpha", alpha)
    if not _is_number(h_alpha) or not 0 < h_alpha < 1:
        problems.append(f"{where}: 'alpha' must be in (0, 1), got {h_alpha!r}")
    _check_windowing(h, compare, where, windows, problems)
    _check_gamma(h, where, problems)
    model = h.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        problems.append(f"{where}: 'model' must be a model name")
    if problems or compare is None:
        return None
    return Hypothesis(
        id=h["id"], family=h["family"], metric=h["metric"], compare=(compare[0], compare[1]),
        direction=h.get("direction", "two-sided"), test=h.get("test", "wilcoxon"),
        correction=h.get("correction", "holm"), split=h.get("split", "confirmatory"),
        policy=h.get("policy"), window=h.get("window"), alpha=float(h_alpha), model=model,
        description=str(h.get("description", "")), margin=margin, worse=worse, gamma=h.get("gamma"))


def _check_gamma(h: Mapping[str, Any], where: str, problems: list[str]) -> None:
    """``gamma``: required by the speculative-decoding metrics, an integer >= 1, and nowhere else."""
    metric, gamma = h.get("metric"), h.get("gamma")
    if metric in SPECULATIVE_METRICS:
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            problems.append(f"{where}: metric {metric!r} needs 'gamma' (drafts per target call, an integer "
                            f">= 1), got {gamma!r}")
    elif gamma is not None:
        problems.append(f"{where}: 'gamma' applies only to the speculative-decoding metrics "
                        f"{list(SPECULATIVE_METRICS)}")


def _default_worse(metric: Any) -> str:
    """The estimand table's ``worse`` for ``metric`` ("larger" for metrics it does not list, e.g. branch_tv)."""
    if metric in SPECULATIVE_METRICS:
        return SPECULATIVE_METRICS[metric]
    if metric in ANSWER_METRICS:
        return ANSWER_METRICS[metric]
    try:
        return by_name(str(metric)).worse
    except KeyError:
        return "larger"


def _check_margin(h: Mapping[str, Any], compare: list[str] | None, where: str,
                  problems: list[str]) -> tuple[float | None, str]:
    """``margin`` / ``worse`` of a test at a margin, and ``full`` as side B (problems appended)."""
    direction, margin, worse = h.get("direction", "two-sided"), h.get("margin"), h.get("worse")
    if worse is not None and worse not in WORSE:
        problems.append(f"{where}: 'worse' must be one of {list(WORSE)}, got {worse!r}")
    worse = worse if worse in WORSE else _default_worse(h.get("metric"))
    if compare is not None and compare[0] == FULL:
        problems.append(f"{where}: {FULL!r} (the full model) can only be side B of 'compare' [A, {FULL!r}]")
    if direction not in MARGIN_ALTERNATIVES:
        for key in ("margin", "worse"):
            if key in h:
                problems.append(f"{where}: {key!r} applies only to direction {list(MARGIN_ALTERNATIVES)}")
        return None, worse
    if h.get("test", "wilcoxon") not in MARGIN_TESTS:
        problems.append(f"{where}: direction {direction!r} tests the mean difference: 'test' must be one of "
                        f"{list(MARGIN_TESTS)}, got {h.get('test', 'wilcoxon')!r}")
    if not _is_number(margin) or not math.isfinite(margin) or margin == 0:
        problems.append(f"{where}: direction {direction!r} needs a finite non-zero 'margin', got {margin!r}")
        return None, worse
    if margin < 0 and not (direction == "noninferiority" and worse == "smaller"):
        problems.append(f"{where}: 'margin' must be > 0 (negative only for a non-inferiority margin where "
                        f"smaller is worse), got {margin!r}")
    return abs(float(margin)), worse


def _validate_compare(compare: Any, where: str, problems: list[str]) -> list[str] | None:
    """The [A, B] pair, or None (with the problem recorded) when it is not two strings."""
    if not (isinstance(compare, list) and len(compare) == 2 and all(isinstance(c, str) and c for c in compare)):
        problems.append(f"{where}: 'compare' must be two strings [A, B] (the effect is A - B), got {compare!r}")
        return None
    if compare[0] == compare[1]:
        problems.append(f"{where}: 'compare' names {compare[0]!r} twice")
    return compare


def _check_windowing(h: Mapping[str, Any], compare: list[str] | None, where: str,
                     windows: Mapping[str, tuple[int, int]], problems: list[str]) -> None:
    """``policy`` (two windows of one policy) and ``window`` (two policies in one window) rules."""
    policy, window, metric = h.get("policy"), h.get("window"), h.get("metric")
    if policy is not None:
        # Two windows of one policy: only windowed metrics make sense.
        if not isinstance(policy, str) or not policy:
            problems.append(f"{where}: 'policy' must be a policy id string")
        if metric not in WINDOW_METRICS:
            problems.append(f"{where}: comparing windows needs a windowed metric {WINDOW_METRICS}, "
                            f"got {metric!r}")
        if window is not None:
            problems.append(f"{where}: give either 'policy' (compare two windows) or 'window' "
                            "(compare two policies in one window), not both")
        for w in compare or []:
            if w not in windows:
                problems.append(f"{where}: window {w!r} is not defined in [windows] "
                                f"(defined: {sorted(windows)})")
    elif metric in WINDOW_METRICS:
        if window is None:
            problems.append(f"{where}: metric {metric!r} needs 'window' (a name from [windows]) "
                            "when comparing policies, or 'policy' when comparing windows")
        elif window not in windows:
            problems.append(f"{where}: window {window!r} is not defined in [windows] (defined: {sorted(windows)})")
    elif window is not None:
        problems.append(f"{where}: 'window' applies only to windowed metrics {WINDOW_METRICS}")


def _check_choice(h: Mapping[str, Any], key: str, choices: Sequence[str], default: str, where: str,
                  problems: list[str]) -> None:
    value = h.get(key, default)
    if value not in choices:
        problems.append(f"{where}: {key!r} must be one of {list(choices)}, got {value!r}")


def _check_families(hyps: Sequence[Hypothesis], problems: list[str]) -> None:
    # Holm needs one alpha and one correction per family.
    fams: dict[str, list[Hypothesis]] = {}
    for h in hyps:
        fams.setdefault(h.family, []).append(h)
    for fam, members in fams.items():
        if len({m.alpha for m in members}) > 1:
            problems.append(f"family {fam!r}: hypotheses use different alpha values; a family shares one")
        if len({m.correction for m in members}) > 1:
            problems.append(f"family {fam!r}: hypotheses mix corrections; a family uses one")


# ---------------------------------------------------------------------------
# The document split
# ---------------------------------------------------------------------------

def split_uniform(doc_id: str, salt: str) -> float:
    """sha256(salt + ":" + doc_id) read as a uniform number in [0, 1).

    Parameters
    ----------
    doc_id : str
        The document id.
    salt : str
        The plan's salt.

    Returns
    -------
    float
        The first 8 bytes of the digest as a big-endian integer, divided by 2**64.

    Examples
    --------
    >>> 0 <= split_uniform("doc0", "kvdiv-paper-v1") < 1
    True
    """
    digest = hashlib.sha256(f"{salt}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def assign_split(doc_ids: Sequence[str], salt: str, confirmatory_fraction: float = 0.5) -> list[str]:
    """The authoritative split: confirmatory iff the salted hash falls below the fraction.

    Parameters
    ----------
    doc_ids : sequence of str
        Document ids (anything else is converted with ``str``).
    salt : str
        The plan's salt.
    confirmatory_fraction : float
        The plan's confirmatory fraction.

    Returns
    -------
    list of str
        ``"confirmatory"`` or ``"exploratory"`` per document, in order.

    Examples
    --------
    >>> assign_split(["a", "b"], "s", 1.0)
    ['confirmatory', 'confirmatory']
    """
    return ["confirmatory" if split_uniform(str(d), salt) < confirmatory_fraction else "exploratory"
            for d in doc_ids]


def split_table(doc_ids: Sequence[str], plan: Plan, dataset_split: Sequence[str] | None = None) -> pd.DataFrame:
    """doc → plan split, the dataset's split label (if any) and whether they agree.

    Parameters
    ----------
    doc_ids : sequence of str
        Document ids.
    plan : Plan
        The plan whose salt and fraction define the split.
    dataset_split : sequence of str, optional
        The data's own split labels; a blank label means "not assigned" and is
        not a disagreement.

    Returns
    -------
    pandas.DataFrame
        Columns ``doc``, ``split``, ``dataset_split``, ``agrees``.

    Raises
    ------
    PlanError
        When ``dataset_split`` does not hold one label per document.

    Examples
    --------
    >>> t = split_table(["doc0"], load_plan("paper"), ["exploratory"])
    >>> t.columns.tolist()
    ['doc', 'split', 'dataset_split', 'agrees']
    """
    ids = [str(d) for d in doc_ids]
    table = pd.DataFrame({"doc": ids, "split": assign_split(ids, plan.salt, plan.confirmatory_fraction)})
    ds_split = [str(s) for s in dataset_split] if dataset_split is not None else [""] * len(ids)
    if len(ds_split) != len(ids):
        raise PlanError(f"{len(ds_split)} split labels for {len(ids)} documents")
    table["dataset_split"] = ds_split
    table["agrees"] = [(s == "" or s == p) for s, p in zip(ds_split, table["split"], strict=True)]
    return table


def split_disagreement_note(table: pd.DataFrame, limit: int = 5) -> str | None:
    """A sentence describing disagreements with the dataset's split labels, or None.

    Parameters
    ----------
    table : pandas.DataFrame
        A :func:`split_table`.
    limit : int
        How many disagreeing documents to name.

    Returns
    -------
    str or None
        None when every label agrees (or is blank).

    Examples
    --------
    >>> split_disagreement_note(split_table(["doc0"], load_plan("paper"))) is None
    True
    """
    bad = table.loc[~table["agrees"]]
    if bad.empty:
        return None
    examples = ", ".join(f"{r.doc} (data: {r.dataset_split}, plan: {r.split})" for r in bad.head(limit).itertuples())
    return (f"{len(bad)} of {len(table)} documents carry a dataset split label that disagrees with the "
            f"plan's hash split; the plan's split was used (e.g. {examples}).")


def parse_aliases(items: Sequence[str]) -> dict[str, str]:
    """Parse run-time policy substitutions (``--policy-alias PLANNED=ACTUAL``).

    Parameters
    ----------
    items : sequence of str
        Items of the form ``PLANNED=ACTUAL``.

    Returns
    -------
    dict of str to str
        Planned policy id → data policy id.

    Raises
    ------
    PlanError
        For an item that is not ``PLANNED=ACTUAL``.

    Examples
    --------
    >>> parse_aliases(["snapkv#512=snapkv#128"])
    {'snapkv#512': 'snapkv#128'}
    """
    out: dict[str, str] = {}
    for item in items:
        planned, eq, actual = item.partition("=")
        if not eq or not planned.strip() or not actual.strip():
            raise PlanError(f"policy alias {item!r} must be PLANNED=ACTUAL, e.g. snapkv#512=snapkv#128")
        out[planned.strip()] = actual.strip()
    return out

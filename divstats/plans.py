"""Prespecified analysis plans (docs/statistics.md §8): load, split documents, run, correct.

A plan is a TOML file written before the data are looked at. It fixes the
document split (a salted hash of the document id), the early/late age windows and
every hypothesis: metric, the two things compared, direction, test, family and
correction. :func:`run_plan` evaluates it on a trace dataset and returns one row
per hypothesis (and per model when the data hold several), with Holm-adjusted
p-values within each family. The format is documented in ``docs/plans.md``.

Labelling rule: a row is *confirmatory* only if its hypothesis is planned on the
confirmatory split and was run exactly as written. Rows on other splits, and rows
whose policies were substituted after the fact (``aliases=`` / ``--policy-alias``),
are exploratory; substitutions are listed as deviations.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from divstats.paired import ALTERNATIVES, TESTS, holm, paired_test

TABLE_COLUMNS: tuple[str, ...] = (
    "id", "family", "metric", "n_docs", "statistic", "p_value", "p_adjusted", "reject",
    "effect", "ci_low", "ci_high", "confirmatory",
)
EXTRA_COLUMNS: tuple[str, ...] = (
    "label", "model", "a", "b", "policy", "window", "direction", "test", "correction", "split",
    "alpha", "effect_kind", "mean_a", "mean_b", "mean_difference", "mean_ci_low", "mean_ci_high",
    "hodges_lehmann", "hl_ci_low", "hl_ci_high", "deviation", "note",
)
SPLITS: tuple[str, ...] = ("confirmatory", "exploratory", "all")
CORRECTIONS: tuple[str, ...] = ("holm", "none")
WINDOW_METRICS: tuple[str, ...] = ("branch_tv",)

_PLAN_KEYS = {"name", "description", "alpha", "salt", "confirmatory_fraction"}
_HYP_KEYS = {"id", "family", "metric", "compare", "policy", "window", "direction", "test",
             "correction", "split", "alpha", "model", "description"}
_TOP_KEYS = {"plan", "windows", "aliases", "hypothesis"}


class PlanError(ValueError):
    """A plan that is ill-formed, or that does not fit the data it is run on."""


class NotIdentified(PlanError):
    """A hypothesis whose metric these traces cannot identify (short horizon or window).

    ``run_plan`` does not stop on it: the row is reported with NaN results and the
    reason in its ``note``, and the reason is added to the notes.
    """


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

    @property
    def compares_windows(self) -> bool:
        return self.policy is not None


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


def _canonical_json(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str).encode("utf-8")


def load_plan(source: str | Path | Mapping[str, Any]) -> Plan:
    """Read and validate a plan from a TOML path, TOML text, or a dict.

    Raises :class:`PlanError` listing every problem found. The plan's SHA-256 is of
    the file's bytes, or of canonical JSON (sorted keys, compact) for a dict.
    """
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


def _read_source(source: str | Path) -> tuple[bytes, str]:
    path = Path(source) if not (isinstance(source, str) and "\n" in source) else None
    if path is not None and path.exists():
        return path.read_bytes(), str(path)
    if isinstance(source, str) and ("[plan]" in source or "\n" in source):
        return source.encode("utf-8"), "<text>"
    raise PlanError(f"plan file {str(source)!r} does not exist")


def _validate(raw: dict[str, Any], problems: list[str]) -> Plan | None:
    for key in sorted(set(raw) - _TOP_KEYS):
        problems.append(f"unknown top-level table {key!r} (expected {sorted(_TOP_KEYS)})")
    head = raw.get("plan")
    if not isinstance(head, Mapping):
        problems.append("missing [plan] table (name, alpha, salt, confirmatory_fraction)")
        head = {}
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
    windows = _validate_windows(raw.get("windows", {}), problems)
    aliases = _validate_aliases(raw.get("aliases", {}), problems)
    hyps = _validate_hypotheses(raw.get("hypothesis"), windows, float(alpha), problems)
    if problems:
        return None
    return Plan(name=name, alpha=float(alpha), salt=salt, confirmatory_fraction=float(fraction),
                windows=windows, hypotheses=tuple(hyps), aliases=aliases,
                description=str(head.get("description", "")))


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
        n_before = len(problems)
        for key in sorted(set(h) - _HYP_KEYS):
            problems.append(f"{where}: unknown key {key!r} (expected {sorted(_HYP_KEYS)})")
        for key in ("id", "family", "metric"):
            if not isinstance(h.get(key), str) or not h.get(key):
                problems.append(f"{where}: {key!r} must be a non-empty string")
        if isinstance(h.get("id"), str):
            if h["id"] in seen:
                problems.append(f"{where}: duplicate id {h['id']!r}")
            seen.add(h["id"])
        compare = h.get("compare")
        if not (isinstance(compare, list) and len(compare) == 2 and all(isinstance(c, str) and c for c in compare)):
            problems.append(f"{where}: 'compare' must be two strings [A, B] (the effect is A - B), got {compare!r}")
            compare = None
        elif compare[0] == compare[1]:
            problems.append(f"{where}: 'compare' names {compare[0]!r} twice")
        policy, window = h.get("policy"), h.get("window")
        _check_choice(h, "direction", ALTERNATIVES, "two-sided", where, problems)
        _check_choice(h, "test", TESTS, "wilcoxon", where, problems)
        _check_choice(h, "correction", CORRECTIONS, "holm", where, problems)
        _check_choice(h, "split", SPLITS, "confirmatory", where, problems)
        h_alpha = h.get("alpha", alpha)
        if not _is_number(h_alpha) or not 0 < h_alpha < 1:
            problems.append(f"{where}: 'alpha' must be in (0, 1), got {h_alpha!r}")
        if policy is not None:
            # Two windows of one policy: only windowed metrics make sense.
            if not isinstance(policy, str) or not policy:
                problems.append(f"{where}: 'policy' must be a policy id string")
            if h.get("metric") not in WINDOW_METRICS:
                problems.append(f"{where}: comparing windows needs a windowed metric {WINDOW_METRICS}, "
                                f"got {h.get('metric')!r}")
            if window is not None:
                problems.append(f"{where}: give either 'policy' (compare two windows) or 'window' "
                                "(compare two policies in one window), not both")
            for w in compare or []:
                if w not in windows:
                    problems.append(f"{where}: window {w!r} is not defined in [windows] "
                                    f"(defined: {sorted(windows)})")
        elif h.get("metric") in WINDOW_METRICS:
            if window is None:
                problems.append(f"{where}: metric {h.get('metric')!r} needs 'window' (a name from [windows]) "
                                "when comparing policies, or 'policy' when comparing windows")
            elif window not in windows:
                problems.append(f"{where}: window {window!r} is not defined in [windows] (defined: {sorted(windows)})")
        elif window is not None:
            problems.append(f"{where}: 'window' applies only to windowed metrics {WINDOW_METRICS}")
        model = h.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            problems.append(f"{where}: 'model' must be a model name")
        if len(problems) == n_before:
            hyps.append(Hypothesis(
                id=h["id"], family=h["family"], metric=h["metric"], compare=(compare[0], compare[1]),
                direction=h.get("direction", "two-sided"), test=h.get("test", "wilcoxon"),
                correction=h.get("correction", "holm"), split=h.get("split", "confirmatory"),
                policy=policy, window=window, alpha=float(h_alpha), model=model,
                description=str(h.get("description", ""))))
    _check_families(hyps, problems)
    return hyps


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
    """sha256(salt + ":" + doc_id) read as a uniform number in [0, 1) (first 8 bytes)."""
    digest = hashlib.sha256(f"{salt}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def assign_split(doc_ids: Sequence[str], salt: str, confirmatory_fraction: float = 0.5) -> list[str]:
    """The authoritative split: confirmatory iff the salted hash falls below the fraction."""
    return ["confirmatory" if split_uniform(str(d), salt) < confirmatory_fraction else "exploratory"
            for d in doc_ids]


def split_table(doc_ids: Sequence[str], plan: Plan, dataset_split: Sequence[str] | None = None) -> pd.DataFrame:
    """doc → plan split, the dataset's split label (if any) and whether they agree.

    A blank dataset label means "not assigned" and is not a disagreement.
    """
    ids = [str(d) for d in doc_ids]
    table = pd.DataFrame({"doc": ids, "split": assign_split(ids, plan.salt, plan.confirmatory_fraction)})
    ds_split = [str(s) for s in dataset_split] if dataset_split is not None else [""] * len(ids)
    table["dataset_split"] = ds_split
    table["agrees"] = [(s == "" or s == p) for s, p in zip(ds_split, table["split"])]
    return table


def split_disagreement_note(table: pd.DataFrame, limit: int = 5) -> str | None:
    """A sentence describing disagreements with the dataset's split coord, or None."""
    bad = table.loc[~table["agrees"]]
    if bad.empty:
        return None
    examples = ", ".join(f"{r.doc} (data: {r.dataset_split}, plan: {r.split})" for r in bad.head(limit).itertuples())
    return (f"{len(bad)} of {len(table)} documents carry a dataset split label that disagrees with the "
            f"plan's hash split; the plan's split was used (e.g. {examples}).")


# ---------------------------------------------------------------------------
# Running a plan
# ---------------------------------------------------------------------------

@dataclass
class PlanResult:
    """Outcome of :func:`run_plan`: the results table and everything needed to audit it."""

    plan: Plan
    table: pd.DataFrame
    split: pd.DataFrame
    deviations: list[str]
    notes: list[str]

    @property
    def plan_sha256(self) -> str:
        return self.plan.sha256

    @property
    def split_note(self) -> str | None:
        return split_disagreement_note(self.split)

    def to_dataset(self) -> xr.Dataset:
        """The table as an xarray Dataset over ``hypothesis`` (for results.nc)."""
        t = self.table.reset_index(drop=True)
        data = {}
        for col in t.columns:
            values = t[col].to_numpy()
            if t[col].dtype == object:
                values = np.array(["" if v is None else str(v) for v in values], dtype=object)
            data[f"plan_{col}"] = ("hypothesis", values)
        return xr.Dataset(data, coords={"hypothesis": np.arange(len(t))},
                          attrs={"plan_name": self.plan.name, "plan_sha256": self.plan.sha256,
                                 "deviations": json.dumps(self.deviations),
                                 "notes": json.dumps(self.notes)})


class _Data:
    """Lazily computed per-document quantities the plan needs (computed once each)."""

    def __init__(self, ds: xr.Dataset, window: int | None, estimates: xr.Dataset | None,
                 branch: xr.Dataset | None) -> None:
        self.ds, self.window = ds, window
        self._est, self._branch = estimates, branch
        self.notes: list[str] = []

    @property
    def est(self) -> xr.Dataset:
        if self._est is None:
            from divstats import estimate

            self._est = estimate(self.ds, window=self.window)
        return self._est

    @property
    def branch(self) -> xr.Dataset:
        if self._branch is None:
            from divstats import branch_tv

            self._branch = branch_tv(self.ds, window=self.window)
        return self._branch


def window_mean(branch: xr.Dataset, first: int, last: int) -> xr.DataArray:
    """Per-document average of ``branch_tv`` over ages first..last (both inclusive).

    The unweighted mean of the per-age estimates over ages that some branch can
    reach (NaN ages skipped), i.e. ``divstats.branch_tv_window(ds, first, last + 1)``
    when the window lies inside the horizon.
    """
    ages = branch["age"]
    sel = branch["branch_tv"].where((ages >= first) & (ages <= last), drop=True)
    return sel.mean("age", skipna=True)


def _resolve(policy: str, plan_aliases: Mapping[str, str], aliases: Mapping[str, str]) -> tuple[str, str | None]:
    """Data policy id for a planned id, and the deviation text when substituted post hoc."""
    target = plan_aliases.get(policy, policy)
    if policy in aliases or target in aliases:
        final = aliases.get(policy, aliases.get(target))
        return final, f"{policy} -> {final} (substituted at run time; not in the plan)"
    return target, None


def _check_policy(pid: str, planned: str, data: _Data, hid: str) -> None:
    available = [str(p) for p in data.ds["policy"].values]
    if pid not in available:
        via = f" (planned as {planned!r})" if pid != planned else ""
        raise PlanError(f"hypothesis {hid!r}: policy {pid!r}{via} is not in the data; available: {available}. "
                        "Use --policy-alias PLANNED=ACTUAL to substitute (recorded as a deviation).")


def _metric(data: _Data, h: Hypothesis, plan: Plan, policy: str, which: str | None) -> xr.DataArray:
    """Per-document values of the hypothesis metric for one policy (over doc[, model])."""
    if h.metric in WINDOW_METRICS:
        reason = data.branch["branch_tv"].attrs.get("not_identified")
        if data.branch.attrs.get("kind") == "reference" or (reason and data.branch["branch_tv"].isnull().all()):
            raise NotIdentified(f"hypothesis {h.id!r}: branch_tv is not identified for these traces ({reason})")
        first, last = plan.windows[which]
        ages = data.branch["age"].values
        if ages.size == 0 or first > ages.max():
            raise NotIdentified(f"hypothesis {h.id!r}: window {which!r} = [{first}, {last}] starts beyond the "
                                f"largest age in the data ({int(ages.max()) if ages.size else 'none'}); "
                                "not identified")
        observed = data.branch.attrs.get("window")
        if observed is not None and last > int(observed) and int(observed) < ages.max():
            raise NotIdentified(f"hypothesis {h.id!r}: window {which!r} = [{first}, {last}] needs ages up to "
                                f"{min(last, int(ages.max()))}, but branches are observed only to age W = "
                                f"{observed}; not identified")
        if last > ages.max():
            note = (f"window {which!r} = [{first}, {last}] extends past the largest age in the data "
                    f"({int(ages.max())}); it was averaged over ages {first}..{int(ages.max())}.")
            if note not in data.notes:
                data.notes.append(note)
        return window_mean(data.branch.sel(policy=policy), first, last)
    if h.metric not in data.est.data_vars:
        raise PlanError(f"hypothesis {h.id!r}: unknown metric {h.metric!r}; estimate provides "
                        f"{sorted(str(v) for v in data.est.data_vars)} and windowed {list(WINDOW_METRICS)}")
    return data.est[h.metric].sel(policy=policy)


def _docs_for(split: str, table: pd.DataFrame) -> list[str]:
    if split == "all":
        return table["doc"].tolist()
    return table.loc[table["split"] == split, "doc"].tolist()


def run_plan(ds: xr.Dataset, plan: Plan | str | Path | Mapping[str, Any], *,
             aliases: Mapping[str, str] | None = None, window: int | None = None,
             estimates: xr.Dataset | None = None, branch: xr.Dataset | None = None,
             n_resamples: int = 9999, seed: int = 0) -> PlanResult:
    """Run every hypothesis of ``plan`` on the trace dataset ``ds``.

    ``aliases`` maps planned policy ids to ids in the data (a post-hoc deviation,
    recorded; affected rows are labelled exploratory). ``estimates``/``branch``
    may be passed to reuse ``divstats.estimate(ds)`` / ``divstats.branch_tv(ds)``.
    Raises :class:`PlanError` for a policy, metric, window or split the data cannot serve.
    """
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    aliases = dict(aliases or {})
    data = _Data(ds, window, estimates, branch)
    docs = [str(d) for d in ds["doc"].values]
    ds_split = ds["split"].values if "split" in ds.coords else None
    split = split_table(docs, plan, ds_split)
    notes: list[str] = []
    if (note := split_disagreement_note(split)) is not None:
        notes.append(note)
    unused = sorted(set(aliases) - plan.policies() - set(plan.aliases.values()))
    if unused:
        raise PlanError(f"--policy-alias names {unused}, which the plan does not use; planned policies: "
                        f"{sorted(plan.policies())}")
    rows: list[dict[str, Any]] = []
    deviations: list[str] = []
    for h in plan.hypotheses:
        rows.extend(_run_hypothesis(h, plan, data, split, aliases, deviations, n_resamples, seed))
    notes.extend(data.notes)
    table = _correct(pd.DataFrame(rows), plan)
    table.attrs.update({"plan_name": plan.name, "plan_sha256": plan.sha256})
    return PlanResult(plan=plan, table=table, split=split, deviations=sorted(set(deviations)), notes=notes)


def _models_for(data: _Data, h: Hypothesis) -> list[Any]:
    if "model" not in data.ds.dims:
        if h.model is not None and h.model != str(data.ds.attrs.get("model", "")):
            raise PlanError(f"hypothesis {h.id!r}: model {h.model!r} is not in the data "
                            f"(model: {data.ds.attrs.get('model', '')!r})")
        return [None]
    models = [m for m in data.ds["model"].values]
    if h.model is not None:
        if h.model not in [str(m) for m in models]:
            raise PlanError(f"hypothesis {h.id!r}: model {h.model!r} is not in the data; available: "
                            f"{[str(m) for m in models]}")
        return [m for m in models if str(m) == h.model]
    return models


def _run_hypothesis(h: Hypothesis, plan: Plan, data: _Data, split: pd.DataFrame,
                    aliases: Mapping[str, str], deviations: list[str], n_resamples: int,
                    seed: int) -> list[dict[str, Any]]:
    docs = _docs_for(h.split, split)
    if not docs:
        raise PlanError(f"hypothesis {h.id!r}: the {h.split!r} split has no documents in the data "
                        f"({len(split)} documents; confirmatory_fraction={plan.confirmatory_fraction})")
    devs: list[str] = []
    if h.compares_windows:
        pol, dev = _resolve(h.policy, plan.aliases, aliases)
        _check_policy(pol, h.policy, data, h.id)
        devs += [dev] if dev else []
        sides, labels = (pol, pol), (h.compare[0], h.compare[1], pol)
        windows = h.compare
    else:
        pa, dev_a = _resolve(h.compare[0], plan.aliases, aliases)
        pb, dev_b = _resolve(h.compare[1], plan.aliases, aliases)
        for pid, planned in ((pa, h.compare[0]), (pb, h.compare[1])):
            _check_policy(pid, planned, data, h.id)
        devs += [d for d in (dev_a, dev_b) if d]
        sides, labels = (pa, pb), (pa, pb, "")
        windows = (h.window, h.window)
    deviations.extend(devs)
    models = _models_for(data, h)
    try:
        va = _metric(data, h, plan, sides[0], windows[0])
        vb = _metric(data, h, plan, sides[1], windows[1])
    except NotIdentified as exc:
        data.notes.append(str(exc))
        return [_row(h, m, data, labels, devs, None, np.array([]), np.array([]), str(exc)) for m in models]
    rows = []
    for m in models:
        sa = va.sel(model=m) if m is not None else va
        sb = vb.sel(model=m) if m is not None else vb
        xa = sa.sel(doc=docs).values.astype(float)
        xb = sb.sel(doc=docs).values.astype(float)
        if not (np.isfinite(xa) & np.isfinite(xb)).any():
            why = data.est[h.metric].attrs.get("not_identified", "") if h.metric in data.est else ""
            note = (f"hypothesis {h.id!r}{'' if m is None else f' (model {m})'}: no document has a finite "
                    f"{h.metric!r} for both sides" + (f" ({why})" if why else "") + "; not identified")
            data.notes.append(note)
            rows.append(_row(h, m, data, labels, devs, None, xa, xb, note))
            continue
        res = paired_test(xa, xb, h.test, h.direction, confidence_level=1 - h.alpha,
                          n_resamples=n_resamples, seed=seed)
        rows.append(_row(h, m, data, labels, devs, res, xa, xb, ""))
    return rows


def _row(h: Hypothesis, m: Any, data: _Data, labels: tuple[str, str, str], devs: list[str],
         res: Any, xa: np.ndarray, xb: np.ndarray, note: str) -> dict[str, Any]:
    """One table row; ``res`` None means not evaluated (NaN results, reason in ``note``)."""
    both = np.isfinite(xa) & np.isfinite(xb)
    nan = float("nan")
    get = (lambda name: getattr(res, name)) if res is not None else (lambda name: nan)  # noqa: E731
    multi = m is not None and data.ds.sizes.get("model", 1) > 1
    return {
        "id": f"{h.id}[{m}]" if multi else h.id,
        "family": h.family, "metric": h.metric, "n_docs": res.n if res is not None else 0,
        "statistic": get("statistic"), "p_value": get("pvalue"), "p_adjusted": nan, "reject": False,
        "effect": get("effect"), "ci_low": get("ci_low"), "ci_high": get("ci_high"),
        "confirmatory": h.split == "confirmatory" and not devs,
        "label": "", "model": "" if m is None else str(m), "a": labels[0], "b": labels[1],
        "policy": labels[2], "window": h.window or "", "direction": h.direction, "test": h.test,
        "correction": h.correction, "split": h.split, "alpha": h.alpha,
        "effect_kind": "hodges_lehmann" if h.test == "wilcoxon" else "mean_difference",
        "mean_a": float(np.mean(xa[both])) if both.any() else nan,
        "mean_b": float(np.mean(xb[both])) if both.any() else nan,
        "mean_difference": get("mean_difference"), "mean_ci_low": get("mean_ci_low"),
        "mean_ci_high": get("mean_ci_high"), "hodges_lehmann": get("hodges_lehmann"),
        "hl_ci_low": get("hl_ci_low"), "hl_ci_high": get("hl_ci_high"), "deviation": "; ".join(devs),
        "note": note,
    }


def _correct(table: pd.DataFrame, plan: Plan) -> pd.DataFrame:
    """Holm within each family (over all its rows, models included); 'none' leaves p as is."""
    table = table.copy()
    for _, idx in table.groupby("family", sort=False).groups.items():
        fam = table.loc[idx]
        alpha = float(fam["alpha"].iloc[0])
        if fam["correction"].iloc[0] == "holm":
            reject, adjusted = holm(fam["p_value"].to_numpy(), alpha)
        else:
            adjusted = fam["p_value"].to_numpy(dtype=float)
            reject = np.nan_to_num(adjusted, nan=1.0) < alpha
        table.loc[idx, "p_adjusted"] = adjusted
        table.loc[idx, "reject"] = reject
    table["reject"] = table["reject"].astype(bool)
    table["confirmatory"] = table["confirmatory"].astype(bool)
    table["label"] = np.where(table["confirmatory"], "confirmatory", "exploratory")
    return table[list(TABLE_COLUMNS) + list(EXTRA_COLUMNS)]


def parse_aliases(items: Sequence[str]) -> dict[str, str]:
    """``["snapkv#512=snapkv#128", ...]`` → mapping; refuses malformed items."""
    out: dict[str, str] = {}
    for item in items:
        planned, eq, actual = item.partition("=")
        if not eq or not planned.strip() or not actual.strip():
            raise PlanError(f"policy alias {item!r} must be PLANNED=ACTUAL, e.g. snapkv#512=snapkv#128")
        out[planned.strip()] = actual.strip()
    return out

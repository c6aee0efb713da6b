"""The demo's printed headline (``divstats.report.headline``) on fixed inputs: byte for byte
the text ``kvdiv demo`` printed before the headline moved out of ``kvdiv/demo.py``.

The inputs are literal tables and datasets (no estimation runs), so the expected text pins
the formatting alone: one model and two, a refused hypothesis (NaN), a certified budget and
a refused one, the noise floor present and absent, speculative rows with an interval and
with ± the Monte Carlo SE.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from divstats.report.headline import certify_headline, headline, speculative_headline

MODELS = ["smollm2-135m", "gemma3-270m"]
POLICIES = ["snapkv@0.5", "snapkv#70", "recent@0.5", "full"]
#: The columns kvdiv demo shows per policy (kvdiv.demo_spec.DEMO_STUDY.headline_quantities).
QUANTITIES = ("occurrence", "rmtd", "exposure")


def _plan_rows(model: str | None, shift: float) -> list[dict]:
    tag = "" if model is None else f"[{model}]"
    return [
        dict(id=f"F1-occ-budget{tag}", a="snapkv#70", b="snapkv@0.5", policy="", n_docs=5, mean_a=0.4125 + shift,
             mean_b=0.31, effect=0.1025 + shift, p_adjusted=0.0312, reject=True, label="confirmatory", model=model),
        dict(id=f"F2-rmtd-late{tag}", a="recent@0.5", b="snapkv@0.5", policy="", n_docs=5, mean_a=1.5e-4,
             mean_b=12345.678, effect=-0.0004, p_adjusted=float("nan"), reject=False, label="refused", model=model),
        dict(id=f"F3-tv-window{tag}", a="late", b="early", policy="snapkv@0.5", n_docs=4, mean_a=0.2,
             mean_b=0.1, effect=0.1, p_adjusted=1.0, reject=False, label="exploratory (alias)", model=model),
    ]


def _certify_rows(models: list[str | None]) -> pd.DataFrame:
    rows = []
    for m in models:
        rows.append(dict(id="compress-snapkv", family="snapkv", metric="mismatch_fraction", model=m, margin=0.05,
                         alpha=0.05, certified="snapkv@0.5", certified_kept=0.5123, reason=""))
        rows.append(dict(id="compress-recent", family="recent", metric="mismatch_fraction", model=m, margin=0.05,
                         alpha=0.05, certified=None, certified_kept=float("nan"),
                         reason="the largest budget is not non-inferior"))
    return pd.DataFrame(rows)


def _analysis(models: list[str] | None, *, floor: bool = True) -> SimpleNamespace:
    names = models or [None]
    table = pd.DataFrame([r for i, m in enumerate(names) for r in _plan_rows(m, 0.01 * i)])
    values = np.array([[0.41, 0.3, np.nan, 0.0], [1.234, 0.98765, 2.5, 0.0], [3.0, 2.0, 1.0, 0.0]])
    agg = xr.Dataset({q: ("policy", v) for q, v in zip(QUANTITIES, values, strict=True)},
                     coords={"policy": POLICIES})
    noise = xr.Dataset({"aggregate_occurrence": 0.0, "aggregate_max_tv": 3.2e-7}, attrs={"control": "full"})
    if models:
        agg = xr.concat([agg * (1 + 0.5 * i) for i in range(len(models))], "model").assign_coords(model=models)
        noise = xr.concat([noise + 0.01 * i for i in range(len(models))], "model", combine_attrs="override")
        noise = noise.assign_coords(model=models)
    else:
        table = table.drop(columns="model")
    return SimpleNamespace(plan=SimpleNamespace(name="kvdiv-paper-demo", sha256="0123456789abcdef" * 4),
                           plan_result=SimpleNamespace(table=table, certify=_certify_rows(names)),
                           aggregate=agg, noise_floor=noise if floor else None)


def _speculative(models: list[str] | None) -> SimpleNamespace:
    gammas, drafts = [1, 2, 4], ["snapkv@0.5", "recent@0.5"]
    base = np.array([[1.62, 2.11, 2.875], [1.5, 1.9, 2.4]])
    ds = xr.Dataset({"tokens_per_call": (("policy", "gamma"), base),
                     "tokens_per_call_low": (("policy", "gamma"), base - 0.125),
                     "tokens_per_call_high": (("policy", "gamma"), np.where(base > 2.8, np.inf, base + 0.2)),
                     "tokens_per_call_se": (("policy", "gamma"), np.full_like(base, 0.0333)),
                     "n_docs": 10}, coords={"policy": drafts, "gamma": gammas})
    if models:
        ds = xr.concat([ds + 0.1 * i for i in range(len(models))], "model").assign_coords(model=models)
        ds["n_docs"] = ("model", [10, 8])
    return SimpleNamespace(speculative=ds)


#: The text the pre-split ``kvdiv/demo.py`` (commit 75fa47b) printed for these inputs, case by case.
EXPECTED = json.loads((Path(__file__).parent / "data" / "demo_headline.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize(("case", "models", "floor"), [("one", None, True), ("two", MODELS, True),
                                                       ("one_nofloor", None, False), ("two_nofloor", MODELS, False)])
def test_the_headline_is_byte_identical(case: str, models: list[str] | None, floor: bool) -> None:
    an = _analysis(models, floor=floor)
    assert headline(an, QUANTITIES) + certify_headline(an) == EXPECTED[case]


@pytest.mark.parametrize(("case", "models"), [("spec_one", None), ("spec_two", MODELS)])
def test_the_speculative_headline_is_byte_identical(case: str, models: list[str] | None) -> None:
    assert speculative_headline(_speculative(models)) == EXPECTED[case]


def test_no_certification_adds_nothing() -> None:
    an = _analysis(None)
    an.plan_result.certify = an.plan_result.certify.iloc[:0]
    assert certify_headline(an) == "" and certify_headline(SimpleNamespace(plan_result=None)) == ""


def test_mixed_certifications_name_each_metric_and_margin() -> None:
    an = _analysis(None)
    an.plan_result.certify.loc[1, ["metric", "margin"]] = ["occurrence", 0.1]
    text = certify_headline(an)
    assert "(fixed-sequence, α = 0.05):" in text
    assert "occurrence within 0.1" in text and "mismatch_fraction within 0.05" in text

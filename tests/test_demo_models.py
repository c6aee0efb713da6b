"""The demo studies two models: its analysis paths on traces combined along ``model``
(synthetic datasets from protocols.examples, no model runs): the plan per model with Holm
spanning both, the speculative section per model, the headline per model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import divstats
import protocols
from divstats.report.headline import headline, speculative_headline
from kvdiv.demo_plan import shipped_plan, write_demo_plan
from kvdiv.demo_spec import DEMO_STUDY, MODEL_REPLICATES, DemoConfig, demo_policies, model_slug, template_for
from protocols.examples import example_dataset

MODELS = ["smollm2-135m", "gemma3-270m"]
BUDGET = 70


def _docs() -> list[str]:
    """20 document ids, so that each model has confirmatory documents under the paper plan's split."""
    return [f"pydoc:{i:03d}" for i in range(20)]


def _combined(kind: str, policies: list[str], **kw) -> object:
    sets = [example_dataset(kind, docs=_docs(), policies=policies, replicates=4, horizon=8, seed=s, model=m, **kw)
            for s, m in enumerate(MODELS)]
    return protocols.combine(sets, "model", models=MODELS)


@pytest.fixture(scope="module")
def analysis(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("two-models")
    ds = _combined("residual", demo_policies(BUDGET) + ["full"], window=7)
    plan = write_demo_plan(shipped_plan(), out / "plan.toml", BUDGET, 7, confirmatory_docs=10)
    return divstats.analyze(ds, plan, out / "report", n_resamples=199, progress=False)


def test_every_hypothesis_is_tested_per_model_with_holm_over_both(analysis) -> None:
    table = analysis.plan_result.table
    ids = {h.id for h in analysis.plan.hypotheses}
    for model in MODELS:
        rows = table[table["model"] == model]
        assert {i.split("[")[0] for i in rows["id"]} == ids and all(i.endswith(f"[{model}]") for i in rows["id"])
    for _, fam in table.groupby("family"):
        assert set(fam["model"]) == set(MODELS)          # each family spans both models ...
        p = fam["p_value"].to_numpy()
        if np.isfinite(p).all():                          # ... and Holm runs over all its rows at once
            _, adjusted = divstats.holm(p, float(fam["alpha"].iloc[0]))
            np.testing.assert_allclose(fam["p_adjusted"].to_numpy(), adjusted)


def test_headline_has_a_block_per_model(analysis) -> None:
    text = headline(analysis, DEMO_STUDY.headline_quantities)
    assert "Holm within each family over 2 models" in text
    blocks = text.split("\n  model ")[1:]
    assert [b.split(":")[0] for b in blocks] == MODELS
    for block in blocks:
        assert "F1-occ-budget" in block and "(control: the noise floor)" in block
        assert "noise floor (full vs full)" in block
        assert "[" not in block.split("F1-occ-budget")[1].split()[0]   # the model is the block's, not in the id


def test_report_sections_are_per_model(analysis) -> None:
    summary = Path(analysis.paths["summary.md"]).read_text(encoding="utf-8")
    assert all(m in summary for m in MODELS)


def test_the_speculative_section_per_model(tmp_path: Path) -> None:
    ds = _combined("reference", ["snapkv@0.5", "recent@0.5"])
    an = divstats.analyze(ds, None, tmp_path, n_resamples=199, progress=False, cost_ratio=0.2)
    assert an.speculative.sizes["model"] == 2
    from divstats.report.tables import speculative_rows, speculative_status

    rows = speculative_rows(an)
    assert {r["model"] for r in rows} == set(MODELS) and len(rows) == 2 * 2 * an.speculative.sizes["gamma"]
    assert all(f"({m})" in speculative_status(an) for m in MODELS)
    html = Path(an.paths["report.html"]).read_text(encoding="utf-8")
    assert "Speculative decoding" in html and all(m in html for m in MODELS)
    text = speculative_headline(an)
    assert [line.strip() for line in text.splitlines() if line.strip().startswith("model ")] == \
        [f"model {m}" for m in MODELS]


def test_parts_each_model_in_its_folder_and_a_base_model_reads_raw_text(tmp_path: Path) -> None:
    cfg = DemoConfig(out=tmp_path)
    assert cfg.models == MODELS
    parts = cfg.parts()
    assert [p.out for p in parts] == [tmp_path / "smollm2-135m", tmp_path / "gemma3-270m"]
    assert [p.template for p in parts] == ["summarise", "summarise-raw"]
    assert DemoConfig(out=tmp_path, models=["approx"]).parts()[0].out == tmp_path   # one model: as before
    assert template_for("tiny:llama", "qa") == "qa" and model_slug("tiny:llama") == "tiny-llama"


def test_a_model_at_a_smaller_r_combines_with_absent_replicates_and_keeps_its_estimates(tmp_path: Path) -> None:
    """Gemma's part at R = 2 beside SmolLM2's at R = 4 (MODEL_REPLICATES): the combined traces
    give each model exactly the estimates of its own traces. Reference traces hold no absent
    replicates, so every model's reference set takes the smallest R."""
    from collector.pack import save_dataset
    from kvdiv.demo import _combined as combine_parts

    cfg = DemoConfig(out=tmp_path, models=MODELS, reference_docs=0, passkey_docs=0)
    parts = cfg.parts()
    assert [p.replicates for p in parts] == [MODEL_REPLICATES[m] for m in MODELS] == [4, 2]
    assert DemoConfig(out=tmp_path, models=MODELS, replicates=3).replicates_for("gemma3-270m") == 3
    assert DemoConfig(out=tmp_path, models=MODELS).reference_r() == 2
    assert DemoConfig(out=tmp_path, models=MODELS, replicates=1).reference_r() == 1
    assert DemoConfig(out=tmp_path, models=MODELS, reference_replicates=3).reference_r() == 2
    own = {}
    for seed, part in enumerate(parts):
        part.out.mkdir(parents=True)
        own[part.model] = example_dataset("residual", docs=_docs()[:6], policies=["snapkv@0.5", "full"],
                                          replicates=part.replicates, horizon=8, window=7, seed=seed,
                                          model=part.model)
        save_dataset(own[part.model], part.out / "traces.nc")
    files = combine_parts(cfg, parts)
    combined = protocols.open_traces(files["traces.nc"]).load()
    assert list(files) == ["traces.nc"] and combined.sizes["replicate"] == 4
    for model, ds in own.items():
        alone, inside = divstats.estimate(ds), divstats.estimate(combined.sel(model=model, drop=True))
        for name in ("occurrence", "rmtd", "exposure", "rate"):
            np.testing.assert_allclose(inside[name].values, alone[name].values, rtol=1e-12, equal_nan=True)

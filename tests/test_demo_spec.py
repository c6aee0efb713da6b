"""kvdiv.demo_spec: the study as data, and a run's config over it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import kvdiv.demo_spec as spec_module
from kvdiv.demo_plan import certify_toml
from kvdiv.demo_spec import DEMO_STUDY, DemoConfig, TraceSet, demo_policies


def test_the_policies_are_the_papers_then_the_sweep() -> None:
    assert demo_policies(70) == ["snapkv@0.5", "snapkv#70", "recent@0.5", "snapkv@0.9", "snapkv@0.3", "recent@0.3"]


def test_the_certify_tables_are_one_per_swept_method() -> None:
    assert certify_toml() == "".join(
        f'\n[[certify]]\nid = "compress-{m}"\nfamily = "{m}"\nmetric = "mismatch_fraction"\nmargin = 0.05\n'
        'split = "all"\n' for m in ("snapkv", "recent"))


def test_a_config_defaults_to_the_study_and_options_override_it(tmp_path: Path) -> None:
    cfg = DemoConfig(out=tmp_path)
    assert (cfg.docs_count, cfg.target_tokens, cfg.max_new_tokens, cfg.window, cfg.template, cfg.control) == \
        (DEMO_STUDY.docs_count, DEMO_STUDY.target_tokens, DEMO_STUDY.max_new_tokens, DEMO_STUDY.window,
         DEMO_STUDY.template, DEMO_STUDY.control) == (10, 128, 8, 7, "summarise", True)
    assert cfg.models == ["smollm2-135m", "gemma3-270m"]
    assert cfg.replicates_text() == "4 (smollm2-135m) / 2 (gemma3-270m)"
    assert DemoConfig(out=tmp_path, models=["tiny:llama"]).replicates_for("tiny:llama") == DEMO_STUDY.default_replicates
    assert DemoConfig(out=tmp_path, replicates=3).replicates_text() == "3"
    # what a resume compares: the keys demo.json has always held
    assert set(cfg.sizes()) == {"docs_count", "target_tokens", "max_new_tokens", "window", "seed", "template",
                                "models", "replicates"}


def test_further_trace_sets_take_the_runs_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (ref,) = DemoConfig(out=tmp_path).trace_sets()
    assert (ref.name, ref.kind, ref.file, ref.docs, ref.replicates) == ("reference", "reference", "reference.nc", 10, 2)
    assert DemoConfig(out=tmp_path, reference_docs=0).trace_sets() == []
    assert DemoConfig(out=tmp_path, models=["approx"], reference_replicates=3).trace_sets()[0].replicates == 3
    # a row added to the study is collected too, its R at most the smallest residual R
    extra = TraceSet("passkey", "residual", ("snapkv@0.5",), docs=4, replicates=8)
    monkeypatch.setattr(spec_module, "DEMO_STUDY",
                        dataclasses.replace(DEMO_STUDY, trace_sets=(*DEMO_STUDY.trace_sets, extra)))
    sets = DemoConfig(out=tmp_path).trace_sets()
    assert [ts.name for ts in sets] == ["reference", "passkey"] and sets[1].replicates == 2

"""``kvdiv demo``: end to end against a fake server and a live tiny one; resume; derived plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_collector_support import FakeServer

from collector import documents as D
from kvdiv.demo import run_demo
from kvdiv.demo_documents import budget_for, prompt_length, select_balanced
from kvdiv.demo_plan import demo_windows, shipped_plan, write_demo_plan
from kvdiv.demo_spec import DemoConfig, DemoError, demo_policies

OUTPUTS = ("traces.nc", "results.nc", "report.html", "summary.md", "plan.toml", "documents.jsonl", "reference.nc")


def _small(out: Path, **kw) -> DemoConfig:
    base = dict(out=out, docs_count=8, target_tokens=60, replicates=2, max_new_tokens=8, window=4,
                n_resamples=200, progress=False, reference_docs=4)
    base.update(kw)
    return DemoConfig(**base)


def test_demo_with_a_running_server_resumes_and_refuses_other_sizes(tmp_path: Path, capsys) -> None:
    with FakeServer() as server:
        cfg = _small(tmp_path / "demo", servers=[server.url], models=["approx"])
        an = run_demo(cfg)
        assert all((tmp_path / "demo" / name).exists() for name in OUTPUTS)
        # 4 policies, the sweep's 2 and the control (on by default), and the reference set: 4 docs x 2 drafts
        assert len(server.requests) == 8 * (len(demo_policies(1)) + 1) + 4 * 2
        assert sum(r["kind"] == "reference" for r in server.requests) == 4 * 2
        out = capsys.readouterr().out
        assert "F1-occ-budget" in out and "report: " in out and "snapkv@0.9" in out
        assert "noise floor (full vs full)" in out and "(control: the noise floor)" in out
        assert "How much can I compress?" in out and "none certified" in out   # 8 documents: refused
        # the reference set's own report, with its Speculative decoding section, and its headline
        assert "tokens per target call" in out and "γ = 4" in out
        spec_report = (tmp_path / "demo" / "speculative" / "report.html").read_text(encoding="utf-8")
        assert "Speculative decoding" in spec_report
        assert an.plan.name == "kvdiv-paper-demo" and not an.plan_result.deviations
        policies = {r["candidate"] for r in server.requests}
        budget = int(next(p for p in policies if "#" in p).split("#")[1])
        assert policies == {*demo_policies(budget), "full"}
        import protocols

        first = protocols.open_traces(tmp_path / "demo" / "traces.nc").load()
        reference = protocols.open_traces(tmp_path / "demo" / "reference.nc")
        assert reference.attrs["kind"] == "reference" and reference.sizes["doc"] == 4
        assert list(reference.policy.values) == ["snapkv@0.5", "recent@0.5"]
        run_demo(cfg)  # everything is complete: nothing is asked again
        assert len(server.requests) == 8 * (len(demo_policies(budget)) + 1) + 4 * 2
        assert protocols.open_traces(tmp_path / "demo" / "traces.nc").identical(first)
        with pytest.raises(DemoError, match=r"replicates: \{'approx': 2\} there, \{'approx': 3\} now"):
            run_demo(_small(tmp_path / "demo", servers=[server.url], models=["approx"], replicates=3))


def test_demo_plan_is_the_paper_plan_fitted_to_the_window(tmp_path: Path) -> None:
    from divstats.plans.format import load_plan

    paper = load_plan(shipped_plan())
    path = write_demo_plan(shipped_plan(), tmp_path / "plan.toml", 70, 8)
    plan = load_plan(path)
    assert plan.windows == {"early": (1, 2), "late": (4, 8)} == dict(demo_windows(8))
    assert plan.aliases == {"snapkv#512": "snapkv#70"}
    assert plan.salt == paper.salt and [h.id for h in plan.hypotheses] == [h.id for h in paper.hypotheses]
    before = path.read_bytes()
    write_demo_plan(shipped_plan(), path, 99, 16)  # prespecified: never rewritten for a run
    assert path.read_bytes() == before
    assert [h.direction for h in plan.hypotheses] == [h.direction for h in paper.hypotheses]


def test_demo_plan_is_two_sided_below_the_one_sided_threshold(tmp_path: Path) -> None:
    # 7 confirmatory documents: a one-sided bootstrap-t test would be refused, a two-sided one is not
    from divstats.estimation.resample import MIN_DOCS_MEAN_BOUND
    from divstats.plans.format import load_plan

    paper = load_plan(shipped_plan())
    small = load_plan(write_demo_plan(shipped_plan(), tmp_path / "small.toml", 70, 8, confirmatory_docs=7))
    large = load_plan(write_demo_plan(shipped_plan(), tmp_path / "large.toml", 70, 8,
                                      confirmatory_docs=MIN_DOCS_MEAN_BOUND))
    assert {h.direction for h in small.hypotheses} == {"two-sided"}
    assert [h.direction for h in large.hypotheses] == [h.direction for h in paper.hypotheses]
    assert [h.test for h in small.hypotheses] == [h.test for h in paper.hypotheses]
    assert "two-sided" in (tmp_path / "small.toml").read_text().splitlines()[0]


def test_documents_are_balanced_over_the_plan_split() -> None:
    from divstats.plans.format import assign_split, load_plan

    plan = load_plan(shipped_plan())
    docs = D.pydoc_documents(None, target_tokens=100)
    for n in (7, 14):
        pick = select_balanced(docs, n, shipped_plan())
        labels = assign_split([d.id for d in pick], plan.salt, plan.confirmatory_fraction)
        assert len(pick) == n and labels.count("confirmatory") == (n + 1) // 2
        assert [d.id for d in pick] == [d.id for d in select_balanced(docs, n, shipped_plan())]


def test_budget_is_half_the_median_prompt() -> None:
    docs = [D.Document(str(i), "w " * n) for i, n in enumerate([10, 20, 30])]
    template_words = len(D.TEMPLATES["summarise"].format(text="").split())
    words = lambda messages: sum(len(m["content"].split()) for m in messages)  # noqa: E731
    assert budget_for(docs, "summarise", words) == round((20 + template_words) / 2)
    from gen_service.models.loading import byte_tokenizer

    tok = byte_tokenizer()  # a real chat template: the count includes its role markers
    msgs = D.render_messages(docs[0], "summarise")
    assert prompt_length(tok)(msgs) > len(msgs[0]["content"].encode()) >= prompt_length(None)(msgs) - 8


@pytest.mark.service
def test_demo_starts_and_stops_its_own_server(tmp_path: Path) -> None:
    # the server's life is this test's subject; the reference set and its report are the
    # test above's (no second speculative analysis here)
    cfg = _small(tmp_path / "demo", models=["tiny:llama"], docs_count=6, target_tokens=200, reference_docs=0)
    run_demo(cfg)
    assert all((tmp_path / "demo" / name).exists() for name in OUTPUTS if name != "reference.nc")
    assert not (tmp_path / "demo" / "reference.nc").exists()
    log = (tmp_path / "demo" / "server.log").read_text()
    assert "kvdiv serve ready" in log

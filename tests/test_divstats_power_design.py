"""divstats.design (cheapest documents x replicates) and the ``kvdiv power`` command."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from divstats.design.allocation import CostModel, design
from divstats.design.pilot import hypothesis_pilots
from divstats.design.power import power_at
from divstats.truth.studies import PolicyEffect, simulate_study

PLAN = {"plan": {"name": "d", "alpha": 0.05, "salt": "d", "confirmatory_fraction": 0.5},
        "hypothesis": [{"id": "occ", "family": "f", "metric": "occurrence", "compare": ["a", "b"],
                        "direction": "less", "split": "all", "correction": "none"},
                       {"id": "wrong-way", "family": "g", "metric": "occurrence", "compare": ["a", "b"],
                        "direction": "greater", "split": "all", "correction": "none"}]}


@pytest.fixture(scope="module")
def pilot():
    return simulate_study(12, {"a": PolicyEffect(0.04), "b": PolicyEffect(0.06)}, horizon=8, replicates=6,
                          kind="residual", seed=8)


def test_cost_model_counts_steps_or_fits_recorded_seconds(pilot):
    cm = CostModel.from_traces(pilot)
    assert cm.unit == "decoding steps" and cm.policies == 2
    # residual traces decode the survival path (T) and a branch of K <= T steps
    assert 8 <= cm.steps_per_replicate <= 16
    assert cm.cost(10, 3) == pytest.approx(10 * 2 * (2.0 + 3 * cm.steps_per_replicate))
    # recorded seconds: 0.3 s per request + 1 ms per prompt token + 5 ms per decoded step
    from divstats.traces.replicates import replicate_values

    steps = replicate_values(pilot).values["cost"].sum(-1).reshape(12, 2)
    tokens = np.arange(12) * 50 + 200
    timed = pilot.assign_coords(prompt_tokens=("doc", tokens),
                                elapsed_s=(("doc", "policy"), 0.3 + 0.001 * tokens[:, None] + 0.005 * steps))
    fit = CostModel.from_traces(timed)
    assert fit.unit == "s"
    assert fit.per_step == pytest.approx(0.005, rel=1e-6)
    assert fit.per_prompt_token == pytest.approx(0.001, rel=1e-6)
    assert fit.per_request == pytest.approx(0.3, rel=1e-6)


def test_design_is_the_cheapest_reaching_the_target(pilot):
    res = design(PLAN, pilot, 0.8, replicates=(1, 4, 16), n_sims=1000)
    assert res.unreachable == ["wrong-way"]
    assert res.docs is not None and res.replicates in (1, 4, 16)
    hp = hypothesis_pilots(PLAN, pilot)[0]
    assert power_at(hp, res.docs, res.replicates, n_sims=1000) >= 0.8
    assert power_at(hp, int(res.docs * 0.8), res.replicates, n_sims=1000) < 0.8
    reach = res.table[(res.table["id"] == "occ") & res.table["docs"].notna()]
    assert res.cost == pytest.approx(reach["cost"].min())
    # a conservative design (low end of the range) needs at least as many documents
    low = design(PLAN, pilot, 0.8, replicates=(res.replicates,), use="low", n_sims=1000)
    assert low.docs is None or low.docs >= res.docs
    assert "cheapest design" in res.summary()


def test_expensive_documents_buy_more_replicates(pilot):
    cheap_docs = design(PLAN, pilot, 0.8, CostModel(per_request=0.0, steps_per_replicate=10, policies=2),
                        replicates=(1, 4, 16), n_sims=500)
    dear_docs = design(PLAN, pilot, 0.8, CostModel(per_request=10_000.0, steps_per_replicate=10, policies=2),
                       replicates=(1, 4, 16), n_sims=500)
    assert dear_docs.replicates >= cheap_docs.replicates and dear_docs.docs <= cheap_docs.docs


def test_kvdiv_power_prints_the_table(pilot, tmp_path):
    from kvdiv.cli import main
    from protocols import save_traces

    path = tmp_path / "pilot.nc"
    save_traces(pilot, path)
    plan = tmp_path / "plan.toml"
    plan.write_text('[plan]\nname = "d"\nsalt = "d"\n[[hypothesis]]\nid = "occ"\nfamily = "f"\n'
                    'metric = "occurrence"\ncompare = ["a", "b"]\ndirection = "less"\nsplit = "all"\n')
    res = CliRunner().invoke(main, ["power", str(path), "--plan", str(plan), "--docs", "12", "--docs", "40",
                                    "-R", "2", "--sims", "300", "--target", "0.8"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("occ ") and " a - b " in ln]
    assert len(lines) == 2 and "a - b" in lines[0]
    assert "cheapest design reaching power 0.8" in res.output and "documents for power 0.8" in res.output
    bad = CliRunner().invoke(main, ["power", str(path), "--plan", str(plan), "--policy-alias", "a=zzz"])
    assert bad.exit_code != 0 and "not in the pilot" in bad.output


def test_power_command_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, divstats.cli.power, divstats.design.allocation, divstats.design.power, protocols; "
            "print(sorted(m for m in ('torch', 'transformers', 'httpx', 'gen_service') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

"""The demo's plan: the shipped paper plan fitted to a CPU run, written before any trace exists.

:func:`write_demo_plan` derives it from the study's shipped plan
(``kvdiv.demo_spec.DEMO_STUDY.plan``): ``snapkv#512`` becomes ``snapkv#N`` (a plan alias),
the age windows shrink with W (:func:`demo_windows`), the hypotheses turn two-sided
below the documents a one-sided test of a mean needs, and one ``[[certify]]`` table per
swept method is added (:func:`certify_toml`).
"""

from __future__ import annotations

import re
from importlib.resources.abc import Traversable
from pathlib import Path

from kvdiv.demo_spec import DEMO_STUDY, PLANNED_BUDGET_POLICY, DemoError, budget_policy

__all__ = ["certify_toml", "demo_windows", "shipped_plan", "write_demo_plan"]


def shipped_plan() -> Traversable:
    """The study's shipped plan (package data of divstats, so a wheel install has it too)."""
    from divstats import shipped_plan as packaged

    return packaged(DEMO_STUDY.plan)


def demo_windows(window: int) -> dict[str, tuple[int, int]]:
    """The paper's early/late ages ([1, 8], [16, 32] for W = 32) scaled to the demo's W."""
    return {"early": (1, max(1, window // 4)), "late": (max(2, window // 2), window)}


def certify_toml() -> str:
    """The demo plan's ``[[certify]]`` tables: one per swept method (docs/plans.md, "How much can I compress?")."""
    return "".join(f'\n[[certify]]\nid = "compress-{m}"\nfamily = "{m}"\nmetric = "{DEMO_STUDY.certify_metric}"\n'
                   f'margin = {DEMO_STUDY.certify_margin}\nsplit = "all"\n' for m, _ in DEMO_STUDY.sweep)


def write_demo_plan(source: Path | Traversable, target: Path, budget: int, window: int,
                    confirmatory_docs: int | None = None) -> Path:
    """The demo's plan: the shipped plan with its budget policy and windows fitted to a CPU run.

    Written into the run directory *before* any trace is collected (and never
    rewritten), so it is prespecified: the hypotheses, tests, split salt and
    families are the paper's; only ``snapkv#512`` becomes ``snapkv#N`` (as a plan
    alias, see docs/plans.md) and the age windows shrink with W, because a
    late window of ages 16-32 needs T > 32 decoding steps per branch, several
    times what fits in the demo's minutes on 2 cores. With fewer than
    ``divstats.MIN_DOCS_MEAN_BOUND`` confirmatory documents the
    hypotheses become two-sided: a one-sided test of a mean is refused there (its
    size does not hold on skewed differences, docs/plans.md), a two-sided one holds
    it from 5 documents.

    Raises
    ------
    DemoError
        ``source`` lacks one of the ``[windows]`` lines to adapt.
    """
    if target.exists():
        return target
    from divstats import MIN_DOCS_MEAN_BOUND

    text = source.read_text(encoding="utf-8")
    windows = demo_windows(window)
    for name, (first, last) in windows.items():
        text, n = re.subn(rf"(?m)^{name}\s*=\s*\[[^\]]*\]", f"{name} = [{first}, {last}]", text)
        if n != 1:
            raise DemoError(f"{source}: expected one `{name} = [a, b]` line in [windows] to adapt")
    text = re.sub(r'(?m)^name\s*=\s*"([^"]*)"', r'name = "\1-demo"', text, count=1)
    two_sided = confirmatory_docs is not None and confirmatory_docs < MIN_DOCS_MEAN_BOUND
    if two_sided:
        text = re.sub(r'(?m)^direction\s*=\s*"(less|greater)"', 'direction = "two-sided"', text)
    header = (f"# Derived by `kvdiv demo` from {source.name} before collecting: windows scaled to "
              f"W = {window}, {PLANNED_BUDGET_POLICY} -> {budget_policy(budget)}"
              + (f"; directions two-sided ({confirmatory_docs} confirmatory documents, one-sided tests "
                 f"of a mean need {MIN_DOCS_MEAN_BOUND})" if two_sided else "") + ".\n")
    text = (header + text.rstrip("\n") + f'\n\n[aliases]\n"{PLANNED_BUDGET_POLICY}" = "{budget_policy(budget)}"\n'
            + certify_toml())
    from divstats import load_plan

    load_plan(text)  # refuse to write a plan that does not load
    target.write_text(text, encoding="utf-8")
    return target

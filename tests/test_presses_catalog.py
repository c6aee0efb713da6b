"""Every kvpress press class: its example policy id runs (or is refused) in both trace
kinds on tiny:llama exactly as the catalog claims; docs/service.md shows the table."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

from pathlib import Path

import pytest
from press_artifact_files import write_artifacts

from gen_service.engine.facade import Engine
from gen_service.engine.jobs import TraceJob
from gen_service.errors import PolicyError
from gen_service.models.loading import load_model
from gen_service.presses.catalog import CATALOG, markdown_table
from gen_service.presses.registry import PolicyRegistry
from protocols import StreamWriter, assemble

TEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 3
QUESTION = " Which animal sleeps under the tree, and where?"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "service.md"
BEGIN, END = "<!-- press-table:begin -->", "<!-- press-table:end -->"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    """The operator supplies random-initialised artifacts for the presses that take them."""
    options = write_artifacts(tmp_path_factory.mktemp("artifacts"))
    return Engine(load_model("tiny:llama"), PolicyRegistry(press_options=options))


def test_catalog_lists_every_exported_press() -> None:
    import kvpress

    exported = {n for n in kvpress.__all__ if n.endswith("Press")}
    assert {e.name for e in CATALOG} == exported
    both = sum(e.coupled and e.residual for e in CATALOG)
    assert both >= 40, both  # 46 − 2 abstract − 4 needing an artifact nobody supplies here
    assert {e.name for e in CATALOG if e.artifact} == {"RestoreKVPress", "QFilterPress", "ExpectedAttentionStatsPress"}


@pytest.mark.parametrize("entry", [e for e in CATALOG if e.example], ids=lambda e: e.name)
def test_example_runs_as_claimed(engine: Engine, entry) -> None:
    """Each claimed kind runs from a whole prompt (``inputs``) and from ``context`` +
    ``question`` (the question prefilled after compression, at batch 1, then the rows
    made: per-row press state must follow, CAMPress's running attention sum included)."""
    prompt = list(engine.lm.tokenizer(TEXT).input_ids)
    question = list(engine.lm.tokenizer(QUESTION).input_ids)
    if entry.artifact:  # a server without the operator's artifact refuses it, naming the option
        with pytest.raises(PolicyError, match="--press-option"):
            PolicyRegistry().build(entry.example)
    for kind, claimed in (("coupled", entry.coupled), ("residual", entry.residual)):
        if not claimed:
            with pytest.raises(PolicyError):  # refused before anything streams, with the reason
                engine.registry.build(entry.example)
            continue
        for asked in ([], question):
            job = TraceJob(prompt_ids=prompt, question_ids=asked, candidate=entry.example, kind=kind, horizon=4,
                           replicates=2, seed=1)
            w = StreamWriter()
            lines = [w.line(r) for r in engine.trace(job)]
            ds = assemble([*lines, w.end(4, 2, 0.0)])
            assert ds.attrs["kind"] == kind and ds.sizes["replicate"] == 2


def test_docs_carry_the_generated_table() -> None:
    """Set KVDIV_WRITE_DOCS=1 to rewrite the table in docs/service.md."""
    text = DOCS.read_text()
    table = f"{BEGIN}\n{markdown_table()}\n{END}"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    current = f"{BEGIN}{rest.partition(END)[0]}{END}"
    if os.environ.get("KVDIV_WRITE_DOCS") and current != table:
        DOCS.write_text(head + table + tail)
        return
    assert current == table, "docs/service.md press table is stale: rerun with KVDIV_WRITE_DOCS=1"

"""Every kvpress press class: its example policy id runs (or is refused) in both trace
kinds on tiny:llama exactly as its row of the press table claims
(tests/test_presses_table.py checks the table itself and docs/service.md's copy)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP


import pytest
from press_artifact_files import write_artifacts

from gen_service.engine.facade import Engine
from gen_service.engine.jobs import TraceJob
from gen_service.errors import PolicyError
from gen_service.models.loading import load_model
from gen_service.presses.registry import PolicyRegistry
from gen_service.presses.table import PRESSES
from protocols import StreamWriter, assemble

TEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 3
QUESTION = " Which animal sleeps under the tree, and where?"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    """The operator supplies random-initialised artifacts for the presses that take them."""
    options = write_artifacts(tmp_path_factory.mktemp("artifacts"))
    return Engine(load_model("tiny:llama"), PolicyRegistry(press_options=options))


@pytest.mark.parametrize("entry", [p for p in PRESSES if p.example], ids=lambda p: p.name)
def test_example_runs_as_claimed(engine: Engine, entry) -> None:
    """Each claimed kind runs from a whole prompt (``inputs``) and from ``context`` +
    ``question`` (the question prefilled after compression, at batch 1, then the rows
    made: per-row press state must follow, CAMPress's running attention sum included)."""
    prompt = list(engine.lm.tokenizer(TEXT).input_ids)
    question = list(engine.lm.tokenizer(QUESTION).input_ids)
    if entry.artifact is not None:  # a server without the operator's artifact refuses it, naming the option
        with pytest.raises(PolicyError, match="--press-option"):
            PolicyRegistry().build(entry.example)
    for kind in ("coupled", "residual"):
        if kind not in entry.kinds:
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

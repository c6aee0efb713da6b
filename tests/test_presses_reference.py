"""kvpress is the reference: on the embedded SmolLM2 with a context and a question and
greedy decoding, the candidate side's tokens equal the answer of kvpress's own
``kv-press-text-generation`` pipeline for the same press."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import pytest

pytestmark = pytest.mark.model

CONTEXT = (
    "The Python language reference describes the syntax and core semantics of the language. "
    "It is terse, but attempts to be exact and complete. The semantics of non-essential built-in "
    "object types and of the built-in functions and modules are described in the library reference. "
    "Names refer to objects. Names are introduced by name binding operations. A block is a piece of "
    "Python program text that is executed as a unit: a module, a function body, and a class definition. "
    "The lighthouse keeper of the island was called Marguerite and she kept a blue notebook. "
)  # ~125 tokens: every press still evicts (snapkv's 64-token window fits; DecodingPress's 96 is passed)
QUESTION = "What was the name of the lighthouse keeper, and what did she keep?"
HORIZON = 16


@pytest.fixture(scope="module")
def engine(embedded_lm):
    from gen_service.engine.facade import Engine

    return Engine(embedded_lm)


@pytest.fixture(scope="module")
def pipe(engine):
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    return pipeline("kv-press-text-generation", model=engine.model, tokenizer=engine.lm.tokenizer, device="cpu")


def _ids(pipe) -> tuple[list[int], list[int]]:
    pre = pipe.preprocess(CONTEXT, questions=[QUESTION], answer_prefix="", max_context_length=100000)
    return pre["context_ids"][0].tolist(), pre["questions_ids"][0][0].tolist()


def _candidate_answer(engine, policy: str, context_ids: list[int], question_ids: list[int]) -> str:
    from gen_service.engine.jobs import Sampling, TraceJob

    job = TraceJob(prompt_ids=context_ids, question_ids=question_ids, candidate=policy, horizon=HORIZON,
                   replicates=1, sampling=Sampling(do_sample=False), seed=0)
    ys = [r["y_token"][0] for r in engine.trace(job) if r["type"] == "step"]
    eos = engine.lm.eos_token_id
    ys = ys[:ys.index(eos) + 1] if eos in ys else ys
    return engine.lm.tokenizer.decode(ys, skip_special_tokens=True)


@pytest.mark.parametrize("policy", [
    "snapkv@0.5", "knorm@0.5", "adakv@0.5",
    "kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=96",
])
def test_candidate_tokens_equal_kvpress_pipeline(engine, pipe, policy: str) -> None:
    context_ids, question_ids = _ids(pipe)
    press = engine.registry.build(policy).plan(len(context_ids)).press
    answer = pipe(CONTEXT, question=QUESTION, press=press, max_new_tokens=HORIZON)["answer"]
    assert _candidate_answer(engine, policy, context_ids, question_ids) == answer


def test_pyramidkv_equals_kvpress_by_hand(engine, pipe) -> None:
    """kvpress's pipeline cannot run PyramidKV with a question under SDPA (one causal
    mask for layers of different lengths; kvpress documents per-layer budgets as
    flash-attention only). The reference is then kvpress's press applied by hand, as the
    pipeline does, with the question and the answer fed one token at a time."""
    import torch
    from transformers import DynamicCache

    context_ids, question_ids = _ids(pipe)
    policy = "pyramidkv@0.5"
    press = engine.registry.build(policy).plan(len(context_ids)).press
    model, cache = engine.model, DynamicCache()
    with torch.inference_mode():
        with press(model):
            model.model(input_ids=torch.tensor([context_ids]), past_key_values=cache)
        assert len({layer.keys.shape[-2] for layer in cache.layers}) > 1  # per-layer budgets
        out, pos = [], len(context_ids)
        tokens = list(question_ids)
        for _ in range(len(question_ids) + HORIZON - 1):
            tok = tokens.pop(0) if tokens else out[-1]
            logits = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                           position_ids=torch.tensor([[pos]])).logits[0, -1]
            pos += 1
            if not tokens:
                out.append(int(logits.argmax()))
                if out[-1] == engine.lm.eos_token_id:
                    break
    answer = engine.lm.tokenizer.decode(out, skip_special_tokens=True)
    assert _candidate_answer(engine, policy, context_ids, question_ids) == answer

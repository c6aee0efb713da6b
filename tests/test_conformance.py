"""P is the model itself, on every architecture (tests/conformance_models.py).

For each causal-LM family (tiny random models with their distinctive attention features
on: sliding windows shorter than the prompt, layer-type patterns, soft caps, sinks, q/k
norms, biases, rope scaling, local and global rope) and each way through the engine
(reference, coupled fused and separate, residual prefix and replayed branches,
``/generate``, several requests in one batch, Q on per-row copies), every log-probability
the engine reports for P, and for Q where Q is the full model, equals the model's own
forward over the same tokens (teacher forcing) to 1e-4 in float32. Then: the attention
plan (what takes which path, what is refused), the compression rule for layered attention
and the header fields that report it.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from conformance_models import (
    BY_NAME,
    FAMILIES,
    LOOP_BY_NAME,
    LOOPS,
    PROMPT_LEN,
    WINDOW,
    build,
    loaded,
    prompt,
    run_loop,
)

from gen_service.attention.cascade import prompt_kernel
from gen_service.attention.plan import attention_plan, layer_windows
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import TraceJob
from gen_service.errors import AttentionRefused
from gen_service.presses.layered import LayerRotary, compressible_layers
from protocols import StreamWriter, assemble
from protocols.stream import StreamError, check_header

TOL = 1e-4
#: the loops every family runs in the fast suite; the others are marked slow
FAST = ("reference", "coupled fused", "residual prefix", "batched requests")


@pytest.fixture(scope="module")
def models() -> dict:
    return {}


def _lm(models: dict, name: str):
    if name not in models:
        models[name] = loaded(BY_NAME[name])
    return models[name]


#: and these (the per-row copies' masks when a press left layers of different lengths)
FAST_PAIRS = {("qwen2", "generate"), ("gemma2", "per-row copies")}


@pytest.mark.parametrize(("family", "loop"), [
    pytest.param(f.name, lp.name, marks=() if lp.name in FAST or (f.name, lp.name) in FAST_PAIRS
                 else pytest.mark.slow)
    for f in FAMILIES for lp in LOOPS])
def test_p_is_the_models_own_forward(models: dict, family: str, loop: str) -> None:
    worst = run_loop(_lm(models, family), LOOP_BY_NAME[loop])
    assert worst <= TOL, f"{family} / {loop}: max |Δ log p| = {worst:.3g}"


def test_every_window_is_shorter_than_the_prompt() -> None:
    for fam in FAMILIES:
        windows = [w for w in layer_windows(build(fam).config) if w is not None]
        assert all(w < PROMPT_LEN for w in windows), fam.name
    assert sum(any(layer_windows(build(f).config)) for f in FAMILIES) >= 7


# --------------------------------------------------------------------------- the plan


def test_the_plan_names_each_feature_and_its_path() -> None:
    plan = attention_plan(build(BY_NAME["gemma2"]))
    assert plan.windowed == [0, 2] and plan.compressible == [1, 3]
    assert "attention logit soft-cap" in plan.features and plan.attn_implementation == "eager"
    assert plan.header()["explicit_layers"] == [0, 1, 2, 3] and plan.header()["windows"] == [WINDOW]
    sinks = attention_plan(build(BY_NAME["gpt_oss"]))
    assert "attention sinks" in sinks.features and all(la.sinks for la in sinks.layers)
    plain = attention_plan(build(BY_NAME["llama"]))
    assert plain.windowed == [] and plain.header()["features"] == []
    assert "windowed" not in plain.table()


def test_a_soft_capped_model_loaded_with_sdpa_runs_eager() -> None:
    model = build(BY_NAME["gemma2"])
    model.set_attn_implementation("sdpa")
    attention_plan(model)
    assert model.config._attn_implementation == "eager"


def test_chunked_attention_is_refused_at_load_naming_the_feature() -> None:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              attention_chunk_size=8, num_local_experts=2)
    with pytest.raises(AttentionRefused, match="chunked attention"):
        Engine(_as_lm(Llama4ForCausalLM(config)))


def test_an_unknown_layer_type_is_refused() -> None:
    model = build(BY_NAME["olmo3"])
    model.config.layer_types = ["linear_attention"] * 4
    with pytest.raises(AttentionRefused, match="linear_attention"):
        attention_plan(model, "m")


def _as_lm(model: torch.nn.Module):
    from gen_service.models.loading import LoadedModel, byte_tokenizer

    return LoadedModel(model=model.eval(), tokenizer=byte_tokenizer(), name="m", eos_token_id=None,
                       vocab_size=model.config.vocab_size, max_context=512, device=torch.device("cpu"),
                       dtype=torch.float32)


def test_prompt_kernel_is_a_table_not_a_fallback() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    assert prompt_kernel(cpu, f32, 64, masked=True) == "cpu-flash"
    assert prompt_kernel(cpu, f32, 64, masked=False, softcap=True) == "explicit"
    import gen_service.attention.cascade as cascade

    assert not hasattr(cascade, "_NO_FUSED")


# --------------------------------------------------------------------------- compression


@pytest.mark.parametrize("family", ["gemma3_text", "qwen2", "cohere2", "mistral"])
def test_presses_compress_the_global_layers_only(models: dict, family: str) -> None:
    lm = _lm(models, family)
    engine = Engine(lm)
    ids = prompt(5)
    pre = engine.prefill(engine.registry.resolve("snapkv@0.5"), ids)
    windows = layer_windows(lm.model.config)
    for i, n in enumerate(pre.kept_slots):
        assert n == (PROMPT_LEN if windows[i] is not None else PROMPT_LEN // 2), (family, i)
    head = next(iter(engine.trace(TraceJob(prompt_ids=ids, candidate="snapkv@0.5", horizon=2, replicates=1,
                                           seed=1))))
    glob = compressible_layers(lm.model)
    assert head["compressed_layers"] == glob
    n = len(windows)
    want = (PROMPT_LEN * (n - len(glob)) + PROMPT_LEN // 2 * len(glob)) / (PROMPT_LEN * n)
    assert head["cache_retention"] == pytest.approx(want)
    assert head["attention"]["windowed_layers"] == [i for i, w in enumerate(windows) if w is not None]


@pytest.mark.parametrize("family", ["gemma3_text", "cohere2"])
def test_rerotating_presses_use_each_layers_own_rotary(models: dict, family: str) -> None:
    """Key re-rotation on the global layers with their own frequencies (Gemma 3's global
    rope; none on Cohere 2's global layers: the identity), and P unchanged."""
    lm = _lm(models, family)
    engine = Engine(lm)
    ids = prompt(6)
    recs = [r for r in engine.trace(TraceJob(prompt_ids=ids, candidate="kvpress:KeyRerotationPress(KnormPress)@0.5",
                                             kind="reference", horizon=4, replicates=2,
                                             seed=2)) if isinstance(r, dict)]
    assert recs[0]["compressed_layers"] == compressible_layers(lm.model)
    rotary = lm.model.model.rotary_emb
    if family == "gemma3_text":
        own = LayerRotary(rotary, "full_attention")
        assert torch.equal(own.inv_freq, rotary.full_attention_inv_freq)
        cos, _ = own(torch.zeros(1), torch.arange(3)[None])
        assert torch.allclose(cos, rotary(torch.zeros(1), torch.arange(3)[None], "full_attention")[0])
    else:
        cos, sin = LayerRotary(rotary, None, identity=True)(torch.zeros(1), torch.arange(3)[None])
        assert (cos == 1).all() and (sin == 0).all()
    # the press's rotary embeddings are taken off again
    assert all("rotary_emb" not in layer.self_attn._modules or
               not isinstance(layer.self_attn.rotary_emb, LayerRotary) for layer in lm.model.model.layers)


MIXED = [f.name for f in FAMILIES if len(set(getattr(build(f).config, "layer_types", None) or ())) > 1]


@pytest.mark.parametrize("family", MIXED)
def test_a_question_after_layered_compression_is_one_forward_equal_to_token_by_token(
        models: dict, family: str, monkeypatch) -> None:
    """Global layers compressed, windowed ones whole: the question (longer than the window)
    goes in as one forward with a mask per layer type, and gives the law and the cache
    that feeding it one token at a time (no mask to get wrong) gives."""
    import gen_service.engine.prefill as prefill_mod

    lm = _lm(models, family)
    engine = Engine(lm)
    ids, question = prompt(8), prompt(9, n=2 * WINDOW - 3)
    policies = ["snapkv@0.5"] + (["kvpress:KeyRerotationPress(KnormPress)@0.5"] if family == "gemma3_text" else [])
    for policy in policies:
        plan = engine.registry.resolve(policy)
        made = [engine.prefill(plan, ids) for _ in range(2)]
        lengths = made[0].kept_slots
        assert len(set(lengths)) > 1
        assert prefill_mod.question_masks(lm.model, lengths, len(question)) is not None, family
        one = prefill_mod.prefill_question(lm.model, made[0].side, question)
        with monkeypatch.context() as m:
            m.setattr(prefill_mod, "question_masks", lambda *a: None)
            forwards = []
            real = prefill_mod.run_side
            m.setattr(prefill_mod, "run_side",
                      lambda *a, forwards=forwards, real=real, **k: forwards.append(1) or real(*a, **k))
            want = prefill_mod.prefill_question(lm.model, made[1].side, question)
            assert len(forwards) == len(question)
        assert made[0].side.next_pos == made[1].side.next_pos
        assert (one.log_softmax(-1) - want.log_softmax(-1)).abs().max() <= 1e-5, (family, policy)
        for a, b in zip(made[0].cache.layers, made[1].cache.layers, strict=True):
            assert a.keys.shape == b.keys.shape and torch.allclose(a.keys, b.keys, atol=1e-5), (family, policy)


def test_question_masks_refuse_layers_of_one_type_with_different_lengths(models: dict) -> None:
    from gen_service.engine.prefill import question_masks

    model = _lm(models, "olmo3").model                 # 3 windowed layers, then 1 global
    assert question_masks(model, [40, 40, 40, 20], 5) is not None
    assert question_masks(model, [40, 39, 40, 20], 5) is None
    masks = question_masks(model, [7, 7, 7, 20], 3)
    visible = {k: (m[0, 0] == 0) for k, m in masks.items()}
    assert visible["full_attention"].shape == (3, 23) and visible["full_attention"].sum(1).tolist() == [21, 22, 23]
    # a window of 8: each question token sees itself and the 7 keys before it
    assert visible["sliding_attention"].sum(1).tolist() == [8, 8, 8]
    assert visible["sliding_attention"][2].nonzero().flatten().tolist() == list(range(2, 10))


# --------------------------------------------------------------------------- the wire


def test_header_fields_validate_and_assemble(models: dict) -> None:
    engine = Engine(_lm(models, "gemma3_text"))
    recs = [r for r in engine.trace(TraceJob(prompt_ids=prompt(7), candidate="snapkv@0.5", horizon=3, replicates=2,
                                             seed=3, doc="d")) if isinstance(r, dict)]
    w = StreamWriter()
    ds = assemble([*(w.line(r) for r in recs), w.end(3, 2, 0.1)])
    extra = ds.header_extra.values.item()
    assert '"cache_retention"' in extra and '"compressed_layers": [2]' in extra
    head = dict(recs[0])
    for bad in ({"compressed_layers": [-1]}, {"compressed_layers": "2"}, {"cache_retention": 1.5},
                {"cache_retention": "x"}, {"attention": []}, {"attention": {"windowed_layers": ["a"]}}):
        with pytest.raises(StreamError):
            check_header({**head, **bad})

"""One prefill per document (gen_service/engine/prefill.py ``prefill_document``).

A grouped request prefills P's prompt once: every candidate whose press compresses
after each layer's attention derives its cache from that one forward, and must get
bit for bit the prompt state its own forward gives (``prefill_pair``); the others
prefill their own. Traces must equal the per-candidate prefill's bit for bit.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from gen_service.engine.facade import Engine
from gen_service.engine.forwards import attention_layers
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.engine.prefill import derives_from_full_forward, prefill_document, prefill_pair
from gen_service.errors import CandidateError
from gen_service.models.loading import load_model
from gen_service.presses.registry import ModelInfo
from gen_service.presses.traits import compresses_after_attention

# (policy, derived from the document's forward): every stackable kind, the control, and
# the kinds that prefill their own
POLICIES = [
    ("full", True),
    ("snapkv@0.5", True),
    ("snapkv#40", True),
    ("recent@0.5", True),
    ("knorm@0.5", True),
    ("tova@0.5", True),
    ("expected-attention@0.5", True),
    ("keydiff@0.5", True),
    ("lagkv@0.5", True),
    ("chunkkv@0.5", True),
    ("think@0.5", True),
    ("pyramidkv@0.5", True),
    ("adakv@0.5", True),                 # head-wise masks: indices taken per candidate
    ("criticalkv@0.5", True),
    ("kvpress:KeyRerotationPress(KnormPress)@0.5", True),
    ("kvpress:PerLayerCompressionPress(KnormPress):compression_ratios=0.3;0.7", True),
    ("kvpress:RandomPress@0.5:seed=3", True),
    ("kvpress:RandomPress@0.5", False),  # the global generator: draws would interleave
    ("kvpress:ObservedAttentionPress@0.5", False),   # eager attention
    ("kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=64", False),
    ("kvpress:PrefillDecodingPress(SnapKVPress@0.5, DecodingPress(KnormPress)#64):compression_interval=2", False),
    ("kvpress:DMSPress(KnormPress):threshold=-9.0,sliding_window_size=16,decoding=true", False),
    ("snapkv@0.5+quant:kivi@4", False),
]
PROMPT = list(range(10, 130))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(load_model("tiny:llama"))


def _build(engine: Engine, policy: str):
    return engine.registry.build(policy, ModelInfo.of(engine.lm))


def _tensors(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _assert_same_state(a, b) -> None:
    """Two prompt states bit for bit: cache, masks, logits, positions, kept slots."""
    assert len(a.cache.layers) == len(b.cache.layers)
    for x, y in zip(_tensors(a.cache), _tensors(b.cache), strict=True):
        assert x.shape == y.shape and torch.equal(x, y)
    assert (a.side.masks is None) == (b.side.masks is None)
    for x, y in zip(a.side.masks or (), b.side.masks or (), strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
    assert torch.equal(a.logits, b.logits)
    assert (a.side.next_pos, a.kept, a.kept_slots) == (b.side.next_pos, b.kept, b.kept_slots)


def test_which_presses_derive_from_the_full_forward(engine):
    for policy, derived in POLICIES:
        plan = _build(engine, policy).plan(len(PROMPT))
        assert derives_from_full_forward(plan) is derived, policy
    assert compresses_after_attention(None)


@pytest.mark.parametrize("question", [(), (7, 8, 9, 10, 11)])
def test_every_candidate_gets_the_state_its_own_forward_gives(engine, question):
    ref = _build(engine, "full")
    cands = [_build(engine, p) for p, _ in POLICIES]
    shared = prefill_document(engine.model, ref, cands, PROMPT, question)
    for (policy, _), got in zip(POLICIES, shared, strict=True):
        assert not isinstance(got, Exception), (policy, got)
        if policy == "kvpress:RandomPress@0.5":
            continue   # unseeded: no two prefills draw the same (it prefills its own)
        own = prefill_pair(engine.model, ref, _build(engine, policy), PROMPT, question)
        _assert_same_state(got[0], own[0])
        _assert_same_state(got[1], own[1])


def test_the_prompt_is_prefilled_and_stored_once(engine, monkeypatch):
    ref = _build(engine, "full")
    names = ["snapkv@0.5", "full", "recent@0.5", "adakv@0.5", "kvpress:ObservedAttentionPress@0.5"]
    forwards = []
    first_attention = attention_layers(engine.model)[0]
    hook = first_attention.register_forward_pre_hook(
        lambda m, a, kw: forwards.append(kw["hidden_states"].shape[1]), with_kwargs=True)
    try:
        pairs = prefill_document(engine.model, ref, [_build(engine, n) for n in names], PROMPT)
    finally:
        hook.remove()
    # one forward over the prompt for the document, one more for the press that changes it
    assert forwards == [len(PROMPT), len(PROMPT)]
    first = _tensors(pairs[0][0].cache)
    for p0, _ in pairs:    # every P side (and the control's Q) holds the very same tensors
        assert all(x is y for x, y in zip(_tensors(p0.cache), first, strict=True))
    assert len({id(p0.cache) for p0, _ in pairs}) == len(pairs)   # in caches of their own: each decodes its rows
    assert all(x is y for x, y in zip(_tensors(pairs[1][1].cache), first, strict=True))


@pytest.mark.parametrize("kind", ["coupled", "residual", "reference"])
def test_traces_equal_one_prefill_per_candidate_bit_for_bit(engine, kind):
    cands = [p for p, _ in POLICIES if "Random" not in p and "Observed" not in p and "quant" not in p]
    job = TraceJob(candidate="", candidates=cands, seeds=list(range(len(cands))), prompt_ids=PROMPT,
                   horizon=6, replicates=3, sampling=Sampling(), kind=kind, request_id="r")
    runs = []
    for shared in (True, False):
        engine.shared_prefill = shared
        try:
            runs.append(list(engine.trace(job)))
        finally:
            engine.shared_prefill = True
    assert runs[0] == runs[1]   # headers, tokens and TVs: the same records
    if kind != "reference":
        control = [r for r in runs[0] if isinstance(r, dict) and r.get("candidate") == "full" and "tv" in r]
        assert control and all(tv == 0 for r in control for tv in r["tv"] if tv is not None)


def test_a_failing_press_fails_its_candidate_only(engine, monkeypatch):
    from kvpress import KnormPress

    def broken(self, *args, **kwargs):
        raise RuntimeError("press broke")

    monkeypatch.setattr(KnormPress, "score", broken)
    ref = _build(engine, "full")
    got = prefill_document(engine.model, ref, [_build(engine, p) for p in ("snapkv@0.5", "knorm@0.5", "full")],
                           PROMPT)
    assert isinstance(got[1], RuntimeError) and "press broke" in str(got[1])
    _assert_same_state(got[0][1], prefill_pair(engine.model, ref, _build(engine, "snapkv@0.5"), PROMPT)[1])
    job = TraceJob(candidate="", candidates=["snapkv@0.5", "knorm@0.5"], seeds=[1, 2], prompt_ids=PROMPT,
                   horizon=3, replicates=2, sampling=Sampling(), kind="coupled", request_id="r")
    with pytest.raises(CandidateError) as err:
        list(engine.trace(job))
    assert err.value.index == 1 and "knorm@0.5" in str(err.value)


@pytest.mark.parametrize("family", ["gemma3_text", "cohere2"])
@pytest.mark.parametrize("policy", ["snapkv@0.5", "kvpress:KeyRerotationPress(KnormPress)@0.5"])
def test_derived_compression_follows_the_layered_rule(family, policy):
    """On a model with windowed layers the press derived from the document's forward
    compresses only the global layers, each with its own rotary embedding, exactly as
    the candidate's own prefill (gen_service.presses.layered) does."""
    import conformance_models as cm

    from gen_service.presses.layered import compressible_layers

    eng = Engine(cm.loaded(cm.BY_NAME[family]))
    ids = cm.prompt(n=cm.PROMPT_LEN)
    ref, cand = _build(eng, "full"), _build(eng, policy)
    (p0, q0), = prefill_document(eng.model, ref, [cand], ids)
    own = prefill_pair(eng.model, ref, cand, ids)
    _assert_same_state(p0, own[0])
    _assert_same_state(q0, own[1])
    global_layers = set(compressible_layers(eng.model))
    assert global_layers and len(global_layers) < len(q0.cache.layers)
    for i, layer in enumerate(q0.cache.layers):   # windowed layers keep every slot
        assert (layer.keys.shape[-2] < len(ids)) == (i in global_layers), i

"""The prompt stored once per request (gen_service/attention/shared_cache.py, gen_service/attention/cascade.py).

Cascade attention against SDPA over the concatenated per-row cache; traces with the
shared prompt against the per-row copy path (same seeds: same tokens, TV to rounding)
for every mechanism class, each side taking the path its policy allows.
"""

from __future__ import annotations

import math

import pytest
import torch

from gen_service.attention.cascade import cascade_attention
from gen_service.attention.shared_cache import SharedPromptCache, can_share, share_prompt
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.models.loading import load_model


def _reference(q, pk, pv, rk, rv, scaling, row_mask=None, hidden=None):
    """SDPA over each row's own copy of the prompt followed by its own slots."""
    R, Hq, n, _ = q.shape
    g = Hq // pk.shape[1]
    k = torch.cat([pk.expand(R, -1, -1, -1), rk], 2).repeat_interleave(g, 1)
    v = torch.cat([pv.expand(R, -1, -1, -1), rv], 2).repeat_interleave(g, 1)
    L, m = pk.shape[-2], rk.shape[-2]
    slot = torch.arange(L + m)
    qpos = L + m - n + torch.arange(n)
    allowed = (slot[None] <= qpos[:, None])[None, None].expand(R, 1, n, L + m).clone()
    if row_mask is not None:
        allowed[..., L:] &= row_mask.bool()[:, None, None, :]
    if hidden is not None:   # (R, kv_heads, L + m) -> per query head
        allowed = allowed & ~hidden.repeat_interleave(g, 1)[:, :, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_cascade_equals_attention_over_the_concatenation(n, masked, fused):
    torch.manual_seed(0)
    R, Hkv, g, D, L, m = 5, 2, 3, 8, 11, 6
    q = torch.randn(R, Hkv * g, n, D)
    pk, pv = torch.randn(1, Hkv, L, D), torch.randn(1, Hkv, L, D)
    rk, rv = torch.randn(R, Hkv, m, D), torch.randn(R, Hkv, m, D)
    mask = None
    if masked:  # each row hides some of its older slots, never its newest ones
        mask = torch.rand(R, m) < 0.6
        mask[:, -n:] = True
        mask[0, :-n] = False          # a row that sees none of its older slots
    out = cascade_attention(q, pk, pv, rk, rv, D ** -0.5, mask, fused=fused)
    ref = _reference(q, pk, pv, rk, rv, D ** -0.5, mask)
    assert out.shape == (R, n, Hkv * g, D)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_cascade_hides_keys_per_head(fused):
    """Head-wise presses' masks: the prompt's part shared by every row, the rows' own per row."""
    torch.manual_seed(2)
    R, Hkv, g, D, L, m = 4, 2, 2, 8, 13, 3
    q = torch.randn(R, Hkv * g, 1, D)
    pk, pv = torch.randn(1, Hkv, L, D), torch.randn(1, Hkv, L, D)
    rk, rv = torch.randn(R, Hkv, m, D), torch.randn(R, Hkv, m, D)
    hidden = torch.zeros(R, Hkv, L + m, dtype=torch.bool)
    hidden[:, 0, 2:9] = True           # head 0 loses most of the prompt, head 1 a few keys
    hidden[:, 1, [0, 5]] = True
    hidden[1, 1, L] = True             # row 1 also hides its own first slot from head 1
    out = cascade_attention(q, pk, pv, rk, rv, D ** -0.5, fused=fused, hidden=hidden)
    assert torch.allclose(out, _reference(q, pk, pv, rk, rv, D ** -0.5, hidden=hidden), atol=1e-5)
    plain = cascade_attention(q, pk, pv, rk, rv, D ** -0.5, fused=fused)
    assert not torch.allclose(out, plain, atol=1e-3)   # the masks did change the result


def test_cascade_prompt_only_and_row_mask_of_all_slots():
    torch.manual_seed(1)
    q, pk, pv = torch.randn(3, 4, 1, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    empty = torch.zeros(3, 2, 0, 8)
    ref = _reference(q, pk, pv, empty, empty, 0.3)
    assert torch.allclose(cascade_attention(q, pk, pv, None, None, 0.3), ref, atol=1e-6)
    # a (rows, all slots) mask: only its last columns (the rows' own) are read
    rk, rv = torch.randn(3, 2, 2, 8), torch.randn(3, 2, 2, 8)
    full_mask = torch.ones(3, 9, dtype=torch.long)
    full_mask[1, -2] = 0
    got = cascade_attention(q, pk, pv, rk, rv, 0.3, full_mask)
    assert torch.allclose(got, _reference(q, pk, pv, rk, rv, 0.3, full_mask[:, -2:]), atol=1e-6)


def test_shared_cache_stores_the_prompt_once_and_rows_in_place():
    from transformers import DynamicCache

    dc = DynamicCache()
    prompt = torch.randn(1, 2, 9, 4)
    dc.update(prompt, prompt.clone(), 0)
    cache = SharedPromptCache.from_dynamic(dc, capacity=4)
    cache.batch_repeat_interleave(6)
    layer = cache.layers[0]
    assert layer.prompt_keys.data_ptr() == dc.layers[0].keys.data_ptr()   # taken over, not copied
    k, _ = cache.update(torch.ones(6, 2, 1, 4), torch.ones(6, 2, 1, 4), 0)
    buf = layer.row_keys.data_ptr()
    for _ in range(3):
        k, _ = cache.update(torch.ones(6, 2, 1, 4), torch.ones(6, 2, 1, 4), 0)
    assert layer.row_keys.data_ptr() == buf                       # no per-step reallocation
    assert k.shape == (6, 2, 4, 4) and cache.get_seq_length() == 13
    assert cache.row_bytes() == 2 * 6 * 2 * 4 * 4 * 4             # rows × capacity, not the prompt
    cache.update(torch.ones(6, 2, 1, 4), torch.ones(6, 2, 1, 4), 0)   # past capacity: grows
    assert layer.capacity >= 5 and cache.get_seq_length() == 14
    cache.batch_select_indices(torch.tensor([1, 4]))
    cache.crop(9 + 2)
    assert layer.rows == 2 and cache.get_seq_length() == 11


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:llama")


def _trace(engine, **kw):
    job = TraceJob(prompt_ids=list(range(10, 70)), horizon=10, replicates=6, seed=5,
                   sampling=Sampling(), **kw)
    return list(engine.trace(job))


def _assert_same(a, b, tol=1e-5):
    assert len(a) == len(b)
    for ra, rb in zip(a[1:], b[1:], strict=True):
        assert ra.keys() == rb.keys()
        for key, va in ra.items():
            vb = rb[key]
            if key == "tv":
                assert all((x is None and y is None) or math.isclose(x, y, abs_tol=tol)
                           for x, y in zip(va, vb, strict=True))
            else:
                assert va == vb, key


# one press per mechanism class: prefill-only, head-wise masks, per-layer budgets,
# decoding-time eviction, key-channel pruning
POLICIES = ["snapkv@0.5", "kvpress:AdaKVPress(SnapKVPress)@0.5", "kvpress:PyramidKVPress@0.5",
            "kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=48", "think@0.5",
            "kvpress:DMSPress(KnormPress):threshold=-9.0,sliding_window_size=16,decoding=true"]


@pytest.mark.parametrize("kind", ["coupled", "residual"])
@pytest.mark.parametrize("policy", POLICIES)
def test_shared_prompt_traces_equal_the_per_row_copies(lm, kind, policy):
    shared = _trace(Engine(lm, shared_prompt=True), candidate=policy, kind=kind)
    copies = _trace(Engine(lm, shared_prompt=False), candidate=policy, kind=kind)
    _assert_same(shared, copies)


def test_each_side_takes_the_path_its_policy_allows(lm):
    engine = Engine(lm)
    reg, ids = engine.registry, list(range(10, 70))
    expect = {"snapkv@0.5": True, "kvpress:PyramidKVPress@0.5": True, "think@0.5": True,
              "kvpress:AdaKVPress(SnapKVPress)@0.5": True,
              "kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=48": False,
              "kvpress:DMSPress(KnormPress):threshold=-9.0,sliding_window_size=16,decoding=true": False}
    for policy, ok in expect.items():
        p0, q0 = engine.prefill_pair(reg.resolve("full"), reg.resolve(policy), ids)
        assert can_share(p0.side)                     # the full side always shares
        assert can_share(q0.side) is ok, policy
        assert share_prompt(q0.side, 8) is ok
        assert isinstance(q0.side.cache, SharedPromptCache) is ok


def test_residual_windowed_and_eos_on_the_shared_path(lm):
    kw = dict(candidate="snapkv@0.5", kind="residual", window=3)
    _assert_same(_trace(Engine(lm), **kw), _trace(Engine(lm, shared_prompt=False), **kw))


def test_a_thousand_rows_on_one_prompt(lm):
    """R = 1024: each row costs its own T slots only; the run matches the copy path's tokens."""
    kw = dict(candidate="snapkv@0.5", kind="coupled")
    job = dict(prompt_ids=list(range(10, 70)), horizon=4, replicates=1024, seed=1, sampling=Sampling())
    a = list(Engine(lm).trace(TraceJob(**job, **kw)))
    b = list(Engine(lm, shared_prompt=False).trace(TraceJob(**job, **kw)))
    _assert_same(a, b)
    assert len(a[1]["x_token"]) == 1024


def test_replayed_branches_on_the_shared_path(lm):
    """Branches replayed from the post-prefill snapshot (decoding presses' path), forced
    for a prefill-only press: same records as the copies replaying."""
    engines = []
    for shared in (True, False):
        engine = Engine(lm, shared_prompt=shared)
        engine.force_replay = True
        engines.append(engine)
    kw = dict(candidate="snapkv@0.5", kind="residual")
    _assert_same(_trace(engines[0], **kw), _trace(engines[1], **kw))


@pytest.mark.model
@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_embedded_model_tv_within_1e5_of_the_copies(kind, embedded_lm):
    lm = embedded_lm
    text = "Kernel caches keep the keys and values of every token a model has read. " * 12
    ids = list(lm.tokenizer(text).input_ids)
    job = dict(prompt_ids=ids, candidate="snapkv@0.5", kind=kind, horizon=8, replicates=4, seed=3,
               sampling=Sampling())
    engines = [Engine(lm), Engine(lm, shared_prompt=False)]
    for engine in engines:   # fused in both: "auto" would time fused and apart first (six forwards)
        engine.fuse = "on"
    a, b = (list(engine.trace(TraceJob(**job))) for engine in engines)
    _assert_same(a, b, tol=1e-5)


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_qwen2_on_the_shared_path(kind):
    qwen = load_model("tiny:qwen2")
    kw = dict(candidate="snapkv@0.5", kind=kind)
    _assert_same(_trace(Engine(qwen), **kw), _trace(Engine(qwen, shared_prompt=False), **kw))

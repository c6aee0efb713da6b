"""One attention call per layer for every stacked group (gen_service.attention.shared_cache._Pool,
gen_service.attention.cascade.stacked_cascade_attention) against the group-by-group loop."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import gen_service.attention.shared_cache as shared_cache
from gen_service.attention.cascade import cascade_attention_forward
from gen_service.attention.shared_cache import SharedPromptCache, StackedPromptCache

H, HQ, D = 2, 4, 8


class _Module(torch.nn.Module):
    layer_idx = 0


def _randn(gen: torch.Generator, dev: str, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dev)     # the same numbers on every device


def _group(slots: int, rows: int, filled: int, seed: int, capacity: int = 6, dev: str = "cpu") -> SharedPromptCache:
    gen = torch.Generator().manual_seed(seed)
    dc = DynamicCache()
    dc.update(_randn(gen, dev, 1, H, slots, D), _randn(gen, dev, 1, H, slots, D), 0)
    cache = SharedPromptCache.from_dynamic(dc, capacity=capacity)
    cache.batch_repeat_interleave(rows)
    for _ in range(filled):
        cache.update(_randn(gen, dev, rows, H, 1, D), _randn(gen, dev, rows, H, 1, D), 0)
    return cache


def _step(shape: list[tuple[int, int, int]], mode: str, masks: bool, seed: int = 0, dev: str = "cpu") -> torch.Tensor:
    """One stacked layer forward (write the new token, attend) over fresh groups."""
    groups = [_group(s, r, f, seed + i, dev=dev) for i, (s, r, f) in enumerate(shape)]
    gen = torch.Generator().manual_seed(99)
    n = sum(r for _, r, _ in shape)
    mk = [None] * len(groups)
    if masks:   # a branch-like mask: prompt + own slots, one own slot hidden in each group's first row
        mk = []
        for s, r, f in shape:
            m = torch.ones(r, s + f + 1, dtype=torch.long, device=dev)
            if f:
                m[0, s] = 0
            mk.append(m)
    before = shared_cache.STACKED_ATTENTION
    shared_cache.STACKED_ATTENTION = mode
    try:
        stack = StackedPromptCache(groups, mk, static=mode == "static")
        k, v = _randn(gen, dev, n, H, 1, D), _randn(gen, dev, n, H, 1, D)
        stack.update(k, v, 0)
        for g, m in zip(groups, mk, strict=True):
            g.row_mask = m
        q = _randn(gen, dev, n, HQ, 1, D)
        out, _ = cascade_attention_forward(_Module(), q, k, v, None, kvdiv_shared_cache=stack)
    finally:
        shared_cache.STACKED_ATTENTION = before
    return out


SHAPES = [[(5, 2, 0), (5, 2, 0)],                   # equal everything, the first step
          [(7, 3, 2), (4, 3, 2), (9, 3, 2)],        # prompts of different lengths
          [(7, 1, 2), (4, 3, 2)],                   # different row counts
          [(6, 2, 3), (6, 3, 1), (3, 1, 0)]]        # different fills (residual branches)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masks", [False, True])
def test_one_call_equals_the_group_by_group_loop(shape, masks):
    batched = _step(shape, "batched", masks)
    loop = _step(shape, "loop", masks)
    assert batched.shape == loop.shape
    torch.testing.assert_close(batched, loop, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masks", [False, True])
def test_static_shapes_equal_the_loop(shape, masks):
    """Writes at slots from a tensor, attention over the whole capacity with the unfilled
    slots masked (what a CUDA graph replays): the same numbers."""
    torch.testing.assert_close(_step(shape, "static", masks), _step(shape, "loop", masks), atol=2e-6, rtol=1e-5)


def test_static_shapes_do_not_change_from_step_to_step():
    groups = [_group(5, 2, 0, 0), _group(3, 3, 0, 1)]
    shapes = set()
    for _ in range(3):
        stack = StackedPromptCache(groups, [None, None], static=True)
        stack.update(torch.ones(5, H, 1, D), torch.ones(5, H, 1, D), 0)
        pool = stack.layers[0].pool
        shapes.add((tuple(stack.visible.shape), tuple(stack.write_at.shape), stack.seen,
                    tuple(pool.row_keys.shape), id(pool)))
    assert len(shapes) == 1 and groups[0].layers[0].filled == 3


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_static_stacked_forwards_give_the_same_traces(kind, monkeypatch):
    """The whole model over static-shape stacks (the form a CUDA graph captures), on CPU:
    the same trace as the dynamic stacks, three candidates, branches included."""
    from gen_service.engine.facade import Engine
    from gen_service.engine.forwards import run_stacked
    from gen_service.engine.jobs import Sampling, TraceJob
    from gen_service.models.loading import load_model

    lm = load_model("tiny:llama")
    job = TraceJob(prompt_ids=list(range(10, 70)), horizon=10, replicates=4, seed=3, sampling=Sampling(),
                   candidate="", candidates=["snapkv@0.5", "recent@0.5", "snapkv#30"], seeds=[3, 4, 5], kind=kind)
    traces = []
    for static in (False, True):
        engine = Engine(lm)
        engine.fuse = "on"
        calls = []
        monkeypatch.setattr(engine, "_forward_stacked",
                            lambda fs, s=static, c=calls: c.append(1) or run_stacked(lm.model, fs, s))
        traces.append([r for r in engine.trace(job) if isinstance(r, dict) and r.get("type") != "header"])
        assert calls
    _assert_same_trace(*traces)


def _assert_same_trace(a: list[dict], b: list[dict]) -> None:
    """Same records and tokens, TV equal to floating-point rounding (|ΔTV| ≤ 1e-5)."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra:
            if key == "tv":
                assert all((x is None and y is None) or abs(x - y) <= 1e-5
                           for x, y in zip(ra[key], rb[key], strict=True))
            else:
                assert ra[key] == rb[key], key


def test_cuda_graphs_are_refused_without_cuda():
    from gen_service.api.cli import build_service
    from gen_service.engine.facade import Engine
    from gen_service.errors import ConfigError
    from gen_service.models.loading import load_model

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    with pytest.raises(ConfigError, match="--cuda-graphs needs a CUDA device"):
        build_service("no-such-model", device="cpu", cuda_graphs=True)    # refused before any model load
    engine = Engine(load_model("tiny:llama"))
    with pytest.raises(ConfigError, match="needs a CUDA device; this server runs on cpu"):
        engine.use_cuda_graphs(True)
    assert engine.cuda_graphs is None


def test_the_pool_is_kept_while_the_groups_stay_and_rebuilt_when_rows_change():
    groups = [_group(5, 2, 1, 0), _group(3, 2, 1, 1)]
    first = StackedPromptCache(groups, [None, None]).layers[0].pool
    first_keys = groups[0].layers[0].prompt_keys.clone()
    assert StackedPromptCache(groups, [None, None]).layers[0].pool is first     # no copy per step
    assert torch.equal(groups[0].layers[0].prompt_keys, first_keys)           # the group reads its slice
    groups[1].batch_select_indices(torch.tensor([1]))                          # a branch ended
    again = StackedPromptCache(groups, [None, None]).layers[0].pool
    assert again is not first and again.row_keys.shape[0] == 3
    assert again.prompt_keys is first.prompt_keys and first.row_keys is None   # rows copied, prompts kept


def test_the_pool_grows_past_the_planned_capacity():
    groups = [_group(4, 1, 0, 0, capacity=1), _group(4, 1, 0, 1, capacity=1)]
    for _ in range(3):
        stack = StackedPromptCache(groups, [None, None])
        stack.update(torch.ones(2, H, 1, D), torch.ones(2, H, 1, D), 0)
    assert all(g.layers[0].filled == 3 and g.layers[0].capacity >= 3 for g in groups)


def test_a_stacked_forward_of_several_tokens_is_refused():
    stack = StackedPromptCache([_group(4, 1, 0, 0), _group(4, 1, 0, 1)], [None, None])
    with pytest.raises(ValueError, match="one token per row"):
        stack.update(torch.ones(2, H, 2, D), torch.ones(2, H, 2, D), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_call_on_cuda_equals_the_loop():
    """The batched call on the device (padded prompts take the explicit softmax on CUDA,
    equal prompts the fused kernel) against the group-by-group loop there."""
    for shape in SHAPES:
        for masks in (False, True):
            batched = _step(shape, "batched", masks, dev="cuda")
            loop = _step(shape, "loop", masks, dev="cuda")
            assert batched.device.type == "cuda"
            torch.testing.assert_close(batched, loop, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_cuda_graph_traces_equal_the_eager_ones(kind):
    """Three candidates' stacked forwards replayed from CUDA graphs: the same trace as
    without (fp32; the graph replays the very kernels the eager forward runs)."""
    from gen_service.engine.facade import Engine
    from gen_service.engine.jobs import Sampling, TraceJob
    from gen_service.models.loading import load_model

    lm = load_model("tiny:llama", device="cuda", dtype="float32")
    job = TraceJob(prompt_ids=list(range(10, 70)), horizon=12, replicates=4, seed=3, sampling=Sampling(),
                   candidate="", candidates=["snapkv@0.5", "recent@0.5", "snapkv#30"], seeds=[3, 4, 5], kind=kind)
    traces = []
    for graphs in (False, True):
        engine = Engine(lm)
        engine.fuse = "off"
        engine.use_cuda_graphs(graphs)
        traces.append([r for r in engine.trace(job) if isinstance(r, dict) and r.get("type") != "header"])
        if graphs:    # captured, not fallen back to eager forwards
            assert engine.cuda_graphs.captured > 0 and engine.cuda_graphs.failed is None, engine.cuda_graphs.info()
    _assert_same_trace(*traces)

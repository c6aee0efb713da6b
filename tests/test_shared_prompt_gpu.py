"""On a CUDA device (``-m gpu``; skipped without one): bf16 decoding is exact where it
must be, the shared prompt path equals the per-row copies, and coupled and residual
traces estimate the same quantities. Run by benchmarks/gpu_check.sh."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 6


def _engine(model: str = "tiny:llama", dtype: str = "bfloat16", shared: bool = True):
    from gen_service.engine.facade import Engine
    from gen_service.models.loading import load_model

    return Engine(load_model(model, device="cuda", dtype=dtype), shared_prompt=shared)


def _trace(engine, **kw):
    from gen_service.engine.jobs import TraceJob

    ids = list(engine.lm.tokenizer(TEXT).input_ids)
    return list(engine.trace(TraceJob(prompt_ids=ids, seed=7, **kw)))


def test_bf16_full_against_full_has_zero_tv():
    # P's and Q's forwards apart: the same computation twice. Fused into one batch they
    # may round differently (other kernel shapes), and the float32 logits show it.
    for shared in (True, False):
        engine = _engine("random:llama-1b", shared=shared)
        engine.fuse = "off"
        recs = _trace(engine, candidate="full", horizon=16, replicates=32)
        steps = [r for r in recs if r["type"] == "step"]
        assert all(tv == 0.0 for r in steps for tv in r["tv"])
        assert all(r["x_token"] == r["y_token"] for r in steps)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cascade_equals_sdpa_on_the_device(dtype):
    from gen_service.attention.cascade import cascade_attention

    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    R, Hkv, g, D, L, m = 64, 8, 4, 128, 1000, 9
    q = torch.randn(R, Hkv * g, 1, D, device="cuda", dtype=dt)
    pk, pv = (torch.randn(1, Hkv, L, D, device="cuda", dtype=dt) for _ in range(2))
    rk, rv = (torch.randn(R, Hkv, m, D, device="cuda", dtype=dt) for _ in range(2))
    k = torch.cat([pk.expand(R, -1, -1, -1), rk], 2).repeat_interleave(g, 1)
    v = torch.cat([pv.expand(R, -1, -1, -1), rv], 2).repeat_interleave(g, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()).transpose(1, 2)
    tol = 1e-4 if dtype == "float32" else 2e-2
    for fused in (True, False):
        out = cascade_attention(q, pk, pv, rk, rv, D ** -0.5, fused=fused).float()
        assert torch.allclose(out, ref, atol=tol, rtol=tol), (fused, (out - ref).abs().max())


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_shared_prompt_traces_equal_the_copies_on_the_device(kind):
    kw = dict(candidate="snapkv@0.5", kind=kind, horizon=12, replicates=16)
    a = _trace(_engine(dtype="float32"), **kw)
    b = _trace(_engine(dtype="float32", shared=False), **kw)
    assert len(a) == len(b)
    for ra, rb in zip(a[1:], b[1:], strict=True):
        for key, va in ra.items():
            if key == "tv":
                assert all((x is None and y is None) or math.isclose(x, y, abs_tol=1e-4)
                           for x, y in zip(va, rb[key], strict=True))
            else:
                assert va == rb[key], key


def test_coupled_and_residual_agree_in_bf16():
    import divstats
    from gen_service.engine.jobs import TraceJob
    from protocols import StreamWriter, assemble

    engine = _engine()
    ids = list(engine.lm.tokenizer(TEXT).input_ids)

    def ds(kind, seed):
        job = TraceJob(prompt_ids=ids, candidate="snapkv@0.9", kind=kind, horizon=6, replicates=512,
                       seed=seed, doc="d")
        w = StreamWriter()
        lines = [w.line(r) for r in engine.trace(job)]
        return divstats.estimate(assemble([*lines, w.end(6, 512, 0.0)])).isel(doc=0, policy=0)

    crude, resid = ds("coupled", 11), ds("residual", 12)
    for name in ("occurrence", "rmtd", "loss"):
        se = float(np.hypot(crude[f"{name}_se"], resid[f"{name}_se"]))
        assert se > 0 and abs(float(crude[name] - resid[name])) < 4.5 * se, name

"""Quantized KV caches as candidates (``quant:kivi@2``, ``snapkv@0.5+quant:kivi@4``).

What the candidate's model sees must equal what transformers' ``QuantizedCache`` makes
it see. The reference here is transformers' own ``QuantizedLayer.update`` (prefill,
full-precision residual, flush) with a quantizer written in this file from
optimum-quanto's source (``MaxOptimizer``, ``group``/``ungroup``, ``quantize_affine``,
``QBitsDequantizer``): optimum-quanto needs a C++ extension built at run time, so CI
does not install it. Where it is importable, :func:`test_engine_matches_quanto_backend`
also checks against transformers' ``cache_implementation="quantized"`` with the real
backend.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import numpy as np
import pytest
import torch
from transformers.cache_utils import Cache, QuantizedCache, QuantizedLayer

import divstats
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.errors import PolicyError
from gen_service.models.loading import load_model
from gen_service.presses.quantized import fake_quantize
from gen_service.presses.registry import PolicyRegistry
from protocols import PolicyIdError, StreamWriter, assemble, parse_policy_id

TEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 3
NAMES = ("occurrence", "rmtd", "exposure", "post_mismatch", "loss")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(load_model("tiny:llama"), PolicyRegistry())


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    # 64 tokens: with 2 KV heads, 16 | heads x tokens at every flush below, as quanto's
    # per-channel grouping requires
    return list(engine.lm.tokenizer(TEXT).input_ids)[:64]


# ---------------------------------------------------------------- the reference quantizer

def _group(base: torch.Tensor, axis: int, group_size: int) -> torch.Tensor:
    """optimum.quanto.tensor.grouped.group"""
    axis_dim = base.shape[axis]
    axis_numel = base.numel() // axis_dim
    assert axis_numel % group_size == 0, "quanto refuses this size"
    if axis == 0:
        return base.reshape([-1, group_size])
    grouped = base.reshape((axis_numel // group_size, group_size, axis_dim)).permute(1, 2, 0)
    return grouped.reshape(group_size, axis_dim * (axis_numel // group_size))


def _ungroup(grouped: torch.Tensor, axis: int, shape: torch.Size) -> torch.Tensor:
    """optimum.quanto.tensor.grouped.ungroup"""
    if axis == 0:
        return grouped.reshape(shape)
    group_size, axis_dim = grouped.shape[0], shape[axis]
    out = grouped.reshape(group_size, axis_dim, grouped.numel() // axis_dim // group_size).permute(2, 0, 1)
    return out.reshape(shape)


def reference_quantize(x: torch.Tensor, bits: int, group_size: int, axis: int) -> torch.Tensor:
    """quanto's MaxOptimizer + quantize_affine + dequantize, one batch-1 tensor."""
    g = _group(x, axis, group_size)
    dim = 1 if axis == 0 else 0
    rmin, rmax = torch.amin(g, dim=dim, keepdim=True), torch.amax(g, dim=dim, keepdim=True)
    scale, shift = (rmax - rmin) / (2**bits - 1), -rmin
    data = torch.clamp(torch.round((g + shift) / scale), min=0, max=2**bits - 1).to(torch.uint8)
    out = scale * data
    out -= shift
    return _ungroup(out, axis, x.shape)


class ReferenceLayer(QuantizedLayer):
    """transformers' QuantizedLayer with the reference quantizer (batch 1)."""

    def _quantize(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return reference_quantize(tensor, self.nbits, self.q_group_size, axis)

    def _dequantize(self, q_tensor: torch.Tensor) -> torch.Tensor:
        return q_tensor


class ReferenceCache(QuantizedCache):
    def __init__(self, n_layers: int, bits: int, axis_key: int, axis_value: int, group_size: int, residual: int):
        Cache.__init__(self, layers=[ReferenceLayer(bits, axis_key, axis_value, group_size, residual)
                                     for _ in range(n_layers)])


# ---------------------------------------------------------------- grammar and checks

def test_policy_grammar() -> None:
    spec = parse_policy_id("quant:kivi@2")
    assert spec.press is None and spec.quant.bits == 2 and spec.name == "quant:kivi@2"
    spec = parse_policy_id("kvpress:SnapKVPress@0.5:window_size=8+quant:kivi@4:group_size=16")
    assert spec.params == {"window_size": 8} and spec.quant.params == {"group_size": 16}
    assert spec.name == "kvpress:SnapKVPress+quant:kivi@4" and spec.retention == 0.5
    for bad in ("quant:kivi", "full+quant:kivi@2", "snapkv@0.5+quant:kivi@two", "quant:kivi@2:group_size"):
        with pytest.raises(PolicyIdError):
            parse_policy_id(bad)


@pytest.mark.parametrize("policy, field", [
    ("quant:kivi@3", "quant"), ("quant:hqq@2", "quant"), ("quant:kivi@2:group_size=0", "group_size"),
    ("quant:kivi@2:nbits=4", "nbits"), ("quant:kivi@2:key_axis=head", "key_axis"),
    ("adakv@0.5+quant:kivi@2", "quant"),
    ("kvpress:DecodingPress(KnormPress):target_size=64+quant:kivi@2", "quant"),
])
def test_refused_with_the_reason(engine: Engine, policy: str, field: str) -> None:
    with pytest.raises(PolicyError) as err:
        engine.registry.build(policy)
    assert err.value.field == field


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis, name", [(0, "token"), (-1, "channel")])
def test_fake_quantize_is_quantos_arithmetic_per_row(bits: int, axis: int, name: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 2, 24, 16) * 2
    got = fake_quantize(x, bits, 16, name)
    for r in range(3):  # each row as a batch-1 cache would quantize it
        assert torch.equal(got[r:r + 1], reference_quantize(x[r:r + 1], bits, 16, axis))
    # an item count quanto refuses: the last group is shorter, the others unchanged
    odd = fake_quantize(x[:1, :, :13], bits, 8, name)
    assert odd.shape == (1, 2, 13, 16) and torch.isfinite(odd).all()
    assert len(torch.unique(fake_quantize(x[:1], bits, 16, "token")[0, 0, 0])) <= 2**bits


# ---------------------------------------------------------------- the model sees what transformers' cache shows

def _engine_greedy(engine: Engine, policy: str, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    pre = engine.prefill(engine.registry.build(policy), prompt)
    logits, toks, seen = pre.logits, [], [pre.logits]
    for k in range(n - 1):
        tok = logits.argmax(-1)
        toks.append(int(tok))
        logits = engine.step(pre.side, tok, torch.tensor([pre.side.next_pos + k]))
        seen.append(logits)
    toks.append(int(logits.argmax(-1)))
    return toks, seen


def _reference_greedy(model, cache: Cache, prompt: list[int], n: int, press=None) -> tuple[list[int], list]:
    from contextlib import nullcontext

    ids = torch.tensor([prompt])
    with torch.inference_mode(), (press(model) if press is not None else nullcontext()):
        logits = model(input_ids=ids, past_key_values=cache, position_ids=torch.arange(len(prompt))[None],
                       logits_to_keep=1).logits[:, -1].float()
    toks, seen = [], [logits]
    with torch.inference_mode():
        for k in range(n - 1):
            tok = logits.argmax(-1)
            toks.append(int(tok))
            logits = model(input_ids=tok[:, None], past_key_values=cache,
                           position_ids=torch.tensor([[len(prompt) + k]])).logits[:, -1].float()
            seen.append(logits)
    toks.append(int(logits.argmax(-1)))
    return toks, seen


@pytest.mark.parametrize("bits, key_axis, value_axis", [(2, "channel", "token"), (4, "channel", "token"),
                                                        (2, "token", "token")])
def test_greedy_decoding_matches_transformers_quantized_cache(engine: Engine, prompt: list[int], bits: int,
                                                              key_axis: str, value_axis: str) -> None:
    """20 steps with residual_length 8: the cache is flushed twice while decoding."""
    axes = {"token": 0, "channel": -1}
    n = 20
    policy = f"quant:kivi@{bits}:group_size=16,residual_length=8,key_axis={key_axis},value_axis={value_axis}"
    got, got_logits = _engine_greedy(engine, policy, prompt, n)
    model = engine.model
    ref, ref_logits = _reference_greedy(model, ReferenceCache(2, bits, axes[key_axis], axes[value_axis], 16, 8),
                                        prompt, n)
    assert got == ref
    for a, b in zip(got_logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # transformers' own generate loop over the same cache gives the same tokens
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         past_key_values=ReferenceCache(2, bits, axes[key_axis], axes[value_axis], 16, 8))
    assert out[0, len(prompt):].tolist() == ref
    # and quantization matters: the full cache's logits differ
    _, full_logits = _engine_greedy(engine, "full", prompt, n)
    assert max((a - b).abs().max().item() for a, b in zip(got_logits, full_logits, strict=True)) > 1e-2


def test_press_then_quantization_matches_kvpress_with_a_quantized_cache(engine: Engine, prompt: list[int]) -> None:
    """kvpress compresses a QuantizedCache by dequantize -> compress -> quantize."""
    from kvpress import SnapKVPress

    n = 16
    policy = "kvpress:SnapKVPress@0.5:window_size=16+quant:kivi@4:group_size=16,residual_length=8"
    got, got_logits = _engine_greedy(engine, policy, prompt, n)
    ref, ref_logits = _reference_greedy(engine.model, ReferenceCache(2, 4, -1, 0, 16, 8), prompt, n,
                                        press=SnapKVPress(compression_ratio=0.5, window_size=16))
    assert got == ref
    for a, b in zip(got_logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_question_after_a_quantized_prompt(engine: Engine, prompt: list[int]) -> None:
    """A question is prefilled after the prompt, into the residual (kvpress's pipeline
    with a QuantizedCache does the same), then the answer decodes."""
    # 7 tokens: the first step's flush quantizes 64 + 7 + 1 tokens (quanto needs 16 | 2 x 72)
    question = list(engine.lm.tokenizer(" Whose?").input_ids)
    assert len(question) == 7
    n = 12
    job = TraceJob(prompt_ids=prompt, question_ids=question, candidate="quant:kivi@2:group_size=16,residual_length=8",
                   horizon=n, replicates=1, seed=0, sampling=Sampling(do_sample=False))
    ys = [r["y_token"][0] for r in engine.trace(job) if r["type"] == "step"]
    cache = ReferenceCache(2, 2, -1, 0, 16, 8)
    model = engine.model
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), past_key_values=cache)
        pos = torch.arange(len(prompt), len(prompt) + len(question))[None]
        logits = model(input_ids=torch.tensor([question]), past_key_values=cache, position_ids=pos).logits[:, -1]
        ref = []
        for k in range(n):
            tok = logits.argmax(-1)
            ref.append(int(tok))
            logits = model(input_ids=tok[:, None], past_key_values=cache,
                           position_ids=torch.tensor([[len(prompt) + len(question) + k]])).logits[:, -1]
    assert ys == ref


def test_engine_matches_quanto_backend(engine: Engine, prompt: list[int]) -> None:
    """Against transformers' generate(cache_implementation="quantized") with optimum-quanto
    (skipped where quanto and its run-time C++ build are unavailable)."""
    pytest.importorskip("optimum.quanto")
    n = 20
    config = {"backend": "quanto", "nbits": 2, "axis_key": -1, "axis_value": 0, "q_group_size": 16,
              "residual_length": 8}
    try:
        out = engine.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                    cache_implementation="quantized", cache_config=config,
                                    return_dict_in_generate=True, output_logits=True)
    except (ImportError, RuntimeError, OSError) as exc:  # no ninja / compiler for quanto's extension
        pytest.skip(f"optimum-quanto unusable here: {exc}")
    got, got_logits = _engine_greedy(engine, "quant:kivi@2:group_size=16,residual_length=8", prompt, n)
    assert got == out.sequences[0, len(prompt):].tolist()
    for a, b in zip(got_logits, out.logits, strict=True):
        torch.testing.assert_close(a, b.float(), rtol=0, atol=1e-4)


# ---------------------------------------------------------------- traces

def _trace(engine: Engine, prompt: list[int], policy: str, kind: str, seed: int, R: int, T: int):
    job = TraceJob(prompt_ids=prompt, candidate=policy, kind=kind, horizon=T, replicates=R, seed=seed, doc="d")
    w = StreamWriter()
    lines = [w.line(r) for r in engine.trace(job)]
    return assemble([*lines, w.end(T, R, 0.0)])


# Divergence within T = 6 is moderate for these on the tiny model (about 0.68 and 0.90;
# the cache is flushed every 3 steps), so neither standard error degenerates to 0.
@pytest.mark.parametrize("policy", ["quant:kivi@4:group_size=16,residual_length=3",
                                    "snapkv@0.9+quant:kivi@4:group_size=64,residual_length=3"])
def test_residual_and_coupled_traces_agree(engine: Engine, policy: str) -> None:
    prompt = list(engine.lm.tokenizer(TEXT).input_ids)
    T, R = 6, 256
    crude = divstats.estimate(_trace(engine, prompt, policy, "coupled", 11, R, T)).isel(doc=0, policy=0)
    resid = divstats.estimate(_trace(engine, prompt, policy, "residual", 12, R, T)).isel(doc=0, policy=0)
    for name in NAMES:
        diff = float(crude[name] - resid[name])
        se = float(np.hypot(crude[f"{name}_se"], resid[f"{name}_se"]))
        assert se > 0, name
        assert abs(diff) < 4.5 * se, f"{name}: coupled {float(crude[name]):.4f} vs residual " \
                                     f"{float(resid[name]):.4f} (se {se:.4f})"


def test_policy_examples_build(engine: Engine) -> None:
    """GET /v1/policies lists quantized examples, and every example builds."""
    examples = engine.registry.examples()
    assert "quant:kivi@2" in examples and "snapkv@0.5+quant:kivi@4" in examples
    for example in examples:
        engine.registry.build(example)


@pytest.mark.service
def test_http_quantized_candidate() -> None:
    import json

    from starlette.testclient import TestClient

    from gen_service.api.cli import build_service

    app, _ = build_service("tiny:llama", max_new_tokens=16, max_replicates=4)
    with TestClient(app) as client:
        assert "quant:kivi@2" in client.get("/v1/policies").json()["examples"]
        body = {"inputs": TEXT, "candidate": "snapkv@0.5+quant:kivi@2:residual_length=4", "kind": "residual",
                "replicates": 2, "parameters": {"max_new_tokens": 6, "seed": 1}}
        r = client.post("/v1/traces", json=body)
        assert r.status_code == 200, r.text
        head = json.loads(r.text.splitlines()[0])
        assert head["candidate"]["params"]["bits"] == 2 and head["candidate"]["params"]["residual_length"] == 4
        r = client.post("/v1/traces", json={**body, "candidate": "quant:kivi@3"})
        assert r.status_code == 422 and "@2 or @4" in r.json()["error"], r.text

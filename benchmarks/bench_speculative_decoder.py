"""A real self-speculative decoder on the embedded model, against kvdiv's estimate from reference traces.

Draft = the model with its KV cache compressed by a kvpress policy (the project's
``PolicyRegistry``, prefill-time presses: ``snapkv@0.5``, ``recent@0.5``); target = the
same model with its full cache. One target call: Q drafts γ tokens one forward at a
time, P scores the pending token and the γ drafts in one forward of γ + 1 positions,
accepts draft i with probability min(1, p_i(y_i) / q_i(y_i)), at the first rejection
emits a token of norm((p_i − q_i)+) and ends the call, after γ acceptances emits a
bonus token of p_{γ+1}. Rollback is cropping both caches to the accepted prefix
(``Side.crop``). Sampling is temperature 1 with no truncation, the laws are
:func:`gen_service.engine.coupling.probs` (float32 logits), EOS is absorbing as in the traces.

The estimate: reference traces of the same prompts (``/v1/traces`` ``kind:
"reference"`` through the engine: paths from P with log p and log q of each token),
packed as ``kvdiv pack`` packs them, and :func:`divstats.speculative` on them (the
forward recursion over the drafts accepted in the running call, docs/statistics.md
§10). Both sides count the same thing: the calls until T tokens or the first EOS,
whichever comes first (the decoder stops at an EOS, as a real one does).

Exactness check: per policy, the decoder's mean target calls and the estimate (equal
weights over documents, standard errors from the runs and the replicates) must agree:
|z| < 3 is printed as ``agree``. The wall clock: plain decoding (T one-token forwards
of P) against the speculative decoder on the same prompts, medians of the repeats, and
the cost model T / (calls · (1 + γ c)) with c = one draft step ÷ one target call,
both measured in the same run.

Usage: ``python benchmarks/bench_speculative_decoder.py [--model embedded] [--docs 3]
[--horizon 24] [--gamma 4] [--runs 16] [--replicates 64] [--repeats 3] [--seed 0]``
(about 10 minutes on 2 CPU cores).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import divstats  # noqa: E402
from collector import documents as D  # noqa: E402
from gen_service.engine.coupling import absorb_eos, probs  # noqa: E402
from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import (
    Sampling,  # noqa: E402
    TraceJob,  # noqa: E402
)
from gen_service.engine.sides import Prefilled, Side  # noqa: E402
from gen_service.models.float_head import logits as fp32_logits  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402
from gen_service.presses.registry import ModelInfo  # noqa: E402
from protocols import StreamWriter, assemble  # noqa: E402

POLICIES = ("snapkv@0.5", "recent@0.5")
SAMPLING = Sampling()   # temperature 1, no truncation: the laws the traces hold


# ----------------------------------------------------------------------------- the decoder


def forward_all(engine: Engine, side: Side, tokens: list[int], start: int) -> torch.Tensor:
    """``side`` fed ``tokens`` (emitted positions start.. ) in one forward: (n, V) float32 logits."""
    ids = torch.tensor([tokens], device=engine.device)
    pos = torch.arange(side.next_pos + start, side.next_pos + start + len(tokens), device=engine.device)[None]
    with torch.inference_mode():
        return fp32_logits(engine.model, 0, input_ids=ids, past_key_values=side.cache, position_ids=pos,
                           use_cache=True)[0]


def law(logits: torch.Tensor, prefix: list[int], eos: set[int]) -> torch.Tensor:
    """The processed next-token law (1, V) after ``prefix``: P's and Q's as in the traces (EOS absorbing)."""
    end = next((t for t in prefix if t in eos), -1)
    return absorb_eos(probs(logits[None], SAMPLING), torch.tensor([end >= 0]), torch.tensor([end]))


@dataclass
class Decoder:
    """One speculative decoding of T tokens from a prompt (P full, Q compressed), batch 1."""

    engine: Engine
    p: Prefilled
    q: Prefilled
    gamma: int
    gen: torch.Generator
    eos: set[int]

    def sample(self, w: torch.Tensor) -> int:
        return int(torch.multinomial(w, 1, generator=self.gen))

    def run(self, T: int) -> tuple[list[int], int]:
        """The tokens (T, or fewer up to and including an EOS) and the number of target calls it took."""
        ps, qs = self.p.side, self.q.side
        seq: list[int] = []
        fed_p = fed_q = 0            # emitted tokens each cache holds
        calls = 0
        while len(seq) < T and not self.eos.intersection(seq):   # an EOS ends the text
            calls += 1
            # draft: Q catches up on emitted tokens it has not seen, then drafts γ
            lq = self.q.logits[0] if fed_q == len(seq) == 0 else forward_all(self.engine, qs, seq[fed_q:],
                                                                              fed_q)[-1]
            fed_q = len(seq)
            drafts, q_laws = [], []
            for i in range(self.gamma):
                qi = law(lq, seq + drafts, self.eos)
                y = self.sample(qi)
                drafts.append(y)
                q_laws.append(qi)
                if i < self.gamma - 1:
                    lq = forward_all(self.engine, qs, [y], fed_q + i)[-1]
            # verify: P scores its pending tokens and the drafts in one forward
            pending = seq[fed_p:]
            out = forward_all(self.engine, ps, pending + drafts, fed_p)
            rows = out[len(pending) - 1:] if pending else torch.cat([self.p.logits, out])
            accepted, extra = self.gamma, None
            for i, y in enumerate(drafts):
                pi = law(rows[i], seq + drafts[:i], self.eos)
                a = min(1.0, float(pi[0, y]) / float(q_laws[i][0, y]))
                if float(torch.rand((), generator=self.gen, dtype=torch.float64)) >= a:
                    residual = (pi - q_laws[i]).clamp_min(0.0)
                    extra = self.sample(residual if float(residual.sum()) > 0 else pi)
                    accepted = i
                    break
            if extra is None:
                extra = self.sample(law(rows[self.gamma], seq + drafts, self.eos))
            # rollback: both caches back to the accepted prefix
            old = len(seq)
            seq += drafts[:accepted] + [extra]
            fed_p = old + accepted
            ps.crop([n + fed_p for n in self.p.kept_slots])
            fed_q = old + min(accepted, self.gamma - 1)
            qs.crop([n + fed_q for n in self.q.kept_slots])
        ends = [i for i, t in enumerate(seq) if t in self.eos]
        return seq[:min(T, ends[0] + 1) if ends else T], calls


def plain(engine: Engine, p: Prefilled, T: int, gen: torch.Generator, eos: set[int]) -> list[int]:
    """Plain decoding of T tokens from P, one forward per token (the wall-clock baseline)."""
    seq: list[int] = []
    lp = p.logits[0]
    for t in range(T):
        seq.append(int(torch.multinomial(law(lp, seq, eos), 1, generator=gen)))
        if t < T - 1:
            lp = forward_all(engine, p.side, [seq[-1]], t)[-1]
    return seq


def clock(engine: Engine) -> float:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter()


def fresh(engine: Engine, policy: str, ids: list[int]) -> tuple[Prefilled, Prefilled]:
    info = ModelInfo.of(engine.lm)
    return engine.prefill_pair(engine.registry.build("full", info), engine.registry.build(policy, info), ids)


def step_seconds(engine: Engine, pre: Prefilled, n: int, repeats: int) -> float:
    """Median seconds of one forward of ``n`` positions on a prefilled side (the cache cropped back each time)."""
    times = []
    for _ in range(repeats):
        t0 = clock(engine)
        forward_all(engine, pre.side, list(range(10, 10 + n)), 0)
        times.append(clock(engine) - t0)
        pre.side.crop(list(pre.kept_slots))
    return statistics.median(times)


def estimate(records: list[dict], horizon: int, replicates: int, gamma: int) -> tuple[float, float]:
    """kvdiv's estimate of E[target calls] and its standard error from one request's
    reference records: packed as ``kvdiv pack`` would, then :func:`divstats.speculative`."""
    w = StreamWriter()
    lines = [w.line(r) for r in records] + [w.end(horizon, replicates, 0.0)]
    one = divstats.speculative(assemble(lines, doc="d"), gamma=(gamma,)).sel(gamma=gamma)
    return float(one.target_calls.squeeze()), float(one.target_calls_se.squeeze())


def mean_se(values: np.ndarray) -> tuple[float, float]:
    return float(values.mean()), float(values.std(ddof=1) / math.sqrt(values.size))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--target-tokens", type=int, default=128, help="document length (the demo's)")
    ap.add_argument("--horizon", type=int, default=24)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--runs", type=int, default=16, help="speculative decodings per (doc, policy)")
    ap.add_argument("--replicates", type=int, default=64, help="reference paths per (doc, policy)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (medians)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # the weights' loading bar is not part of the table
    lm = load_model(args.model)
    engine = Engine(lm)
    eos = set(lm.eos_token_ids)
    docs = D.select(D.pydoc_documents(lm.tokenizer, target_tokens=args.target_tokens), args.docs)
    prompts = []
    for doc in docs:
        out = lm.tokenizer.apply_chat_template(D.render_messages(doc, "summarise"), tokenize=True,
                                               add_generation_prompt=True)
        prompts.append(list(out["input_ids"] if not isinstance(out, list) else out))
    T, g = args.horizon, args.gamma
    print(f"model {lm.name} on {lm.device.type}, {len(docs)} documents ({min(map(len, prompts))}-"
          f"{max(map(len, prompts))} prompt tokens), T = {T}, gamma = {g}, {args.runs} decodings and "
          f"{args.replicates} reference paths per (doc, policy)\n")
    rows = []
    for policy in POLICIES:
        real_docs, est_docs, real_se, est_se = [], [], [], []
        spec_s, plain_s, draft_s, target_s = [], [], [], []
        for d, ids in enumerate(prompts):
            seed = args.seed * 1000 + d
            recs = list(engine.trace(TraceJob(prompt_ids=ids, candidate=policy, kind="reference", horizon=T,
                                              replicates=args.replicates, sampling=SAMPLING, seed=seed)))
            m, s = estimate(recs, T, args.replicates, g)
            est_docs.append(m)
            est_se.append(s)
            gen = torch.Generator().manual_seed(seed + 1)
            calls = []
            for run in range(args.runs):
                p, q = fresh(engine, policy, ids)
                t0 = clock(engine)
                _, c = Decoder(engine, p, q, g, gen, eos).run(T)
                if run < args.repeats:
                    spec_s.append(clock(engine) - t0)
                calls.append(c)
            m, s = mean_se(np.array(calls, dtype=float))
            real_docs.append(m)
            real_se.append(s)
            for _ in range(args.repeats):
                p, q = fresh(engine, policy, ids)
                t0 = clock(engine)
                plain(engine, p, T, gen, eos)
                plain_s.append(clock(engine) - t0)
            p, q = fresh(engine, policy, ids)
            draft_s.append(step_seconds(engine, q, 1, 2 * args.repeats + 1))
            target_s.append(step_seconds(engine, p, g + 1, 2 * args.repeats + 1))
        n = len(prompts)
        real, est = float(np.mean(real_docs)), float(np.mean(est_docs))
        se_real = math.sqrt(sum(s * s for s in real_se)) / n
        se_est = math.sqrt(sum(s * s for s in est_se)) / n
        z = (real - est) / math.hypot(se_real, se_est)
        c = statistics.median(draft_s) / statistics.median(target_s)
        measured = statistics.median(plain_s) / statistics.median(spec_s)
        predicted = T / (est * (1 + g * c))
        rows.append((policy, real, se_real, est, se_est, z, c, measured, predicted))
        for d, doc in enumerate(docs):
            print(f"  {policy:<11} {doc.id:<40} decoder calls {real_docs[d]:6.2f} ± {real_se[d]:.2f}   "
                  f"estimate {est_docs[d]:6.2f} ± {est_se[d]:.2f}")
    print()
    head = (f"{'policy':<11} {'decoder tok/call':>17} {'estimate tok/call':>18} {'calls: decoder':>15} "
            f"{'estimate':>14} {'z':>6} {'':>6} {'c':>6} {'speedup measured':>17} {'cost model':>11}")
    print(head)
    print("-" * len(head))
    for policy, real, se_real, est, se_est, z, c, measured, predicted in rows:
        tpc = f"{T / real:.3f} ± {T * se_real / real ** 2:.3f}"
        tpe = f"{T / est:.3f} ± {T * se_est / est ** 2:.3f}"
        verdict = "agree" if abs(z) < 3 else "DIFFER"
        print(f"{policy:<11} {tpc:>17} {tpe:>18} {real:>7.2f} ± {se_real:.2f} {est:>7.2f} ± {se_est:.2f} "
              f"{z:>6.2f} {verdict:>6} {c:>6.3f} {measured:>16.3f}x {predicted:>10.3f}x")
    print(f"\nc = one draft forward (1 token, compressed cache) / one target call ({g + 1} tokens, full cache), "
          "medians; speedup = plain decoding time / speculative time (medians of the repeats, same run); "
          "cost model = T / (calls * (1 + gamma * c)) from the estimate.")


if __name__ == "__main__":
    main()

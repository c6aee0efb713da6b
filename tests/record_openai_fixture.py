"""Record tests/data/openai_logprobs_smollm2.json: OpenAI-format responses from kvdiv's own server.

The full model's samples come over HTTP from a live ``kvdiv serve`` on the embedded
SmolLM2-135M-Instruct: ``POST /v1/chat/completions`` with ``logprobs: true`` (the
``eviction`` is the default, ``full``), recorded verbatim.

The compressed models' log-probabilities of the same tokens: kvdiv's server has no
route that scores a given continuation under a compressed policy (no ``echo``, and
TGI's ``decoder_input_details`` scores the prompt under the full model only), so they
are computed here by teacher forcing through the same service's engine
(``Engine.prefill`` with the policy's press on the prompt, then ``Engine.step`` on
each sampled token, as ``/generate`` decodes), and written as OpenAI
``logprobs.content`` lists.  The full model is scored the same way too, and the
largest difference from the HTTP log-probabilities is recorded: it is the replay
caveat measured for P (teacher-forced scoring against decoding). For each policy the
server also decodes with it (``eviction``), and the same teacher forcing replays its
own tokens: the largest difference from its HTTP log-probabilities is recorded too,
which checks that the scoring here is the server's compressed model.

Token ids: the responses spell tokens as text (``tokenizer.decode([id])``); the
fixture carries the id of every token it uses: the id whose text it is
(``tokenizer.decode([id])``), and where two ids share a text, the one whose full-model
log-probability is the server's; the recorder refuses a text that stands for two ids
in the same fixture.

Usage: PYTHONPATH=. python tests/record_openai_fixture.py   (about a minute on 2 cores)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (docs/service.md)

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

from gen_service.api.cli import build_service
from gen_service.presses.registry import ModelInfo
from gen_service.serving.intake import Message

OUT = Path(__file__).resolve().parent / "data" / "openai_logprobs_smollm2.json"
POLICIES = ("snapkv@0.5", "recent@0.5")
MAX_TOKENS = 24
REPLICATES = 2
DOCS = {
    "fox": "The quick brown fox jumps over the lazy dog. The dog sleeps under an old oak tree near the river, "
           "where children play every afternoon and the miller grinds wheat for the village bakery. "
           "Summarise the scene in one sentence.",
    "tea": "Green tea is made from leaves that are steamed or pan-fired soon after picking, which stops "
           "oxidation and keeps the colour; black tea is rolled and left to oxidise fully before drying. "
           "Explain the difference between green and black tea.",
}


def _serve(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.02)
    return server, thread, url


@torch.inference_mode()
def _teacher_forced(svc, policy_id: str, prompt_ids: list[int], ids: list[list[int]],
                    reported: list[float] | None = None) -> tuple[list[int], list[float]]:
    """The tokens' ids and log q_t(x_t) along them: the policy's prefill, then one decode step per token.

    ``ids[t]`` lists the ids whose text is token t's; with several, the one whose
    log-probability is nearest ``reported[t]`` (the server's own, for the full model).
    """
    engine = svc.engine
    pre = engine.prefill(engine.registry.build(policy_id, ModelInfo.of(engine.lm)), prompt_ids)
    logits, out, chosen = pre.logits, [], []
    for t, cands in enumerate(ids):
        lp = torch.log_softmax(logits.float(), -1)[0]
        tid = cands[0] if reported is None else min(cands, key=lambda i: abs(float(lp[i]) - reported[t]))
        chosen.append(tid)
        out.append(float(lp[tid]))
        if t + 1 < len(ids):
            tok = torch.tensor([tid], device=engine.device)
            pos = torch.full((1,), pre.side.next_pos + t, dtype=torch.long, device=engine.device)
            logits = engine.step(pre.side, tok, pos)
    return chosen, out


def main() -> None:
    app, svc = build_service("embedded")
    tok = svc.tokenizer
    texts: dict[str, list[int]] = {}
    for i in range(len(tok)):
        texts.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
    server, thread, url = _serve(app)
    samples: dict[str, list] = {}
    scores: dict[str, dict[str, list]] = {p: {} for p in (*POLICIES, "full")}
    token_ids: dict[str, int] = {}
    replay_q: dict[str, float] = {}
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            for d, (doc, text) in enumerate(DOCS.items()):
                messages = [{"role": "user", "content": text}]
                prompt_ids = svc.encode_chat(tuple(Message(m["role"], m["content"]) for m in messages))
                samples[doc] = []
                for r in range(REPLICATES):
                    body = {"model": "tgi", "messages": messages, "logprobs": True, "max_tokens": MAX_TOKENS,
                            "temperature": 1.0, "seed": 1000 * d + r}
                    resp = client.post("/v1/chat/completions", json=body)
                    resp.raise_for_status()
                    data = resp.json()
                    content = data["choices"][0]["logprobs"]["content"]
                    cands = [texts[e["token"]] for e in content]
                    ids, lp = _teacher_forced(svc, "full", prompt_ids, cands, [e["logprob"] for e in content])
                    for e, tid in zip(content, ids, strict=True):
                        if token_ids.setdefault(e["token"], tid) != tid:
                            raise SystemExit(f"token text {e['token']!r} stands for ids {token_ids[e['token']]} "
                                             f"and {tid}: pick another seed")
                    samples[doc].append(data)
                    for policy in POLICIES:   # the replay check for Q: the server decoding with the policy
                        own = client.post("/v1/chat/completions", json={**body, "eviction": policy})
                        own.raise_for_status()
                        oc = own.json()["choices"][0]["logprobs"]["content"]
                        oids, olp = _teacher_forced(svc, policy, prompt_ids, [texts[e["token"]] for e in oc],
                                                    [e["logprob"] for e in oc])
                        replay_q[policy] = max(replay_q.get(policy, 0.0),
                                               max(abs(a - e["logprob"]) for a, e in zip(olp, oc, strict=True)))
                    for policy in scores:
                        lq = lp if policy == "full" else _teacher_forced(svc, policy, prompt_ids, [[i] for i in ids])[1]
                        scores[policy].setdefault(doc, []).append(
                            [{"token": e["token"], "logprob": v} for e, v in zip(content, lq, strict=True)])
    finally:
        server.should_exit = True
        thread.join(10)
    full = scores.pop("full")
    replay = max(abs(a["logprob"] - b["logprob"]) for doc in samples for s, f in zip(samples[doc], full[doc],
                 strict=True) for a, b in zip(s["choices"][0]["logprobs"]["content"], f, strict=True))
    fixture = {
        "about": "recorded by tests/record_openai_fixture.py from kvdiv's own server (embedded SmolLM2-135M-Instruct)",
        "model": svc.engine.lm.name, "vocab_size": len(tok), "eos_token_ids": sorted(svc.engine.lm.eos_token_ids),
        "max_tokens": MAX_TOKENS, "policies": list(POLICIES),
        "replay_max_abs_diff_full": replay,
        "replay_max_abs_diff_policy_decoding": replay_q,
        "token_ids": token_ids, "samples": samples, "scores": scores,
    }
    OUT.write_text(json.dumps(fixture, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); teacher-forced vs decoded, max |diff|: full {replay:.2e}, "
          + ", ".join(f"{p} {v:.2e}" for p, v in replay_q.items()))


if __name__ == "__main__":
    main()

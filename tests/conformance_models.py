"""The conformance suite's architectures, as a table: one tiny random model per causal-LM
family, each with its distinctive attention features switched on (tests/test_conformance.py,
benchmarks/conformance_table.py).

Every window is shorter than :data:`PROMPT_LEN`, so the decoding steps attend across
windows' edges; dimensions are tiny (hidden 64, 3-4 layers, vocabulary 320) and weights
float32, so a model builds in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: prompt tokens: longer than every window below
PROMPT_LEN = 40
WINDOW = 8

_COMMON: dict[str, Any] = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=512, initializer_range=0.1, bos_token_id=1,
                               eos_token_id=None, pad_token_id=0)


@dataclass(frozen=True)
class Family:
    """One architecture: its ``model_type``, the config values that switch its features on,
    and what they are (for the table); ``name`` tells two configs of one type apart."""

    model_type: str
    config: dict[str, Any]
    features: str
    attn_implementation: str = "sdpa"
    extra: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.model_type)


FAMILIES: tuple[Family, ...] = (
    Family("llama", dict(tie_word_embeddings=False, attention_bias=True,
                         rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=64)),
           "untied head, attention biases, llama3 rope scaling"),
    Family("mistral", dict(sliding_window=WINDOW, tie_word_embeddings=False),
           f"sliding window {WINDOW} on every layer"),
    Family("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                         tie_word_embeddings=True),
           f"qkv biases, window {WINDOW} on layers >= 1 (layer 0 full), tied head"),
    Family("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                         tie_word_embeddings=False,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                              original_max_position_embeddings=64)),
           f"q/k norms, window {WINDOW} on layer 2, yarn rope"),
    Family("gemma2", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                          num_hidden_layers=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                          query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh"),
           f"alternating window {WINDOW}/global, attention soft-cap 5, final soft-cap 3, query scalar",
           attn_implementation="eager"),
    Family("gemma3_text", dict(sliding_window=WINDOW, num_hidden_layers=4,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                            "sliding_attention"],
                               rope_parameters=dict(full_attention=dict(rope_type="linear", rope_theta=1e6,
                                                                        factor=8.0),
                                                    sliding_attention=dict(rope_type="default",
                                                                           rope_theta=10000.0)),
                               query_pre_attn_scalar=16, final_logit_softcapping=4.0),
           f"window {WINDOW} on 3 of 4 layers, local/global rope (linear-scaled global), q/k norms, "
           "final soft-cap"),
    Family("phi3", dict(sliding_window=WINDOW, tie_word_embeddings=False, partial_rotary_factor=0.5,
                        pad_token_id=0),
           f"fused qkv, window {WINDOW} on every layer, partial rotary"),
    # no window: every layer is compressed, so the presses meet partial rotary (issue 41)
    Family("phi3", dict(tie_word_embeddings=False, partial_rotary_factor=0.5, pad_token_id=0),
           "fused qkv, partial rotary (half of each head rotated), no window", name="phi3_partial"),
    Family("olmo2", dict(tie_word_embeddings=False), "q/k norms (full width), post-norms"),
    Family("olmo3", dict(sliding_window=WINDOW, num_hidden_layers=4,
                         layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                      "full_attention"]),
           f"window {WINDOW} on 3 of 4 layers, q/k norms"),
    Family("gpt_oss", dict(sliding_window=WINDOW, num_hidden_layers=4, num_local_experts=4,
                           num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2,
                           attention_bias=True, tie_word_embeddings=False),
           f"attention sinks, alternating window {WINDOW}/global, MoE, yarn rope", attn_implementation="eager"),
    Family("cohere2", dict(sliding_window=WINDOW, num_hidden_layers=4, logit_scale=0.5,
                           layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                        "full_attention"]),
           f"window {WINDOW} on 3 of 4 layers, rope on windowed layers only, logit scale, parallel block"),
)
BY_NAME = {f.name: f for f in FAMILIES}


def build(family: Family, seed: int = 0) -> torch.nn.Module:
    """The family's tiny random model, float32, eval mode, with its attention implementation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**_COMMON, **family.config}
    config = AutoConfig.for_model(family.model_type, **kw)
    config._attn_implementation = family.attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        for name, p in model.named_parameters():     # sinks and norms are initialised flat
            if name.endswith("sinks"):
                p.data.normal_(0.0, 1.0)
    model.generation_config.eos_token_id = None
    return model.eval().requires_grad_(False)


def loaded(family: Family, seed: int = 0) -> Any:
    """The family's model as gen_service serves it (a LoadedModel without EOS)."""
    from gen_service.models.loading import LoadedModel, byte_tokenizer

    model = build(family, seed)
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), name=f"conformance:{family.name}",
                       eos_token_id=None, vocab_size=model.config.vocab_size, max_context=512,
                       device=torch.device("cpu"), dtype=torch.float32)


def prompt(seed: int = 0, n: int = PROMPT_LEN) -> list[int]:
    """A random prompt of ``n`` ids (3..319: no special ids)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (n,), generator=g).tolist()


@torch.inference_mode()
def own_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float32 next-token log-probabilities of the model's own forward over ``ids``
    (teacher forcing; row i is the law of token i + 1)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False).logits
    return torch.log_softmax(out[0].float(), -1)


# --------------------------------------------------------------------------- the loops

#: a decoding-time press that never evicts at these lengths: Q on the per-row-copies path
#: (the model's own attention over a DynamicCache), which must equal the model as P does
PER_ROW = "kvpress:DecodingPress(KnormPress):compression_interval=500,target_size=500"


@dataclass(frozen=True)
class Loop:
    """One way through the engine: a trace kind (or ``generate``), its settings, and which
    candidates' Q must equal the model too (``exact_q``)."""

    name: str
    kind: str
    candidates: tuple[str, ...] = ("full", "snapkv@0.5")
    fuse: str = "off"
    replay: bool = False
    batched: bool = False
    exact_q: tuple[str, ...] = ("full",)


#: every loop the conformance table covers (columns)
LOOPS: tuple[Loop, ...] = (
    Loop("reference", "reference"),
    Loop("coupled fused", "coupled", fuse="on"),
    Loop("coupled separate", "coupled", fuse="off"),
    Loop("residual prefix", "residual", fuse="on"),
    Loop("residual replay", "residual", replay=True),
    Loop("generate", "generate", candidates=("full", "snapkv@0.5")),
    Loop("batched requests", "coupled", fuse="on", batched=True),
    Loop("per-row copies", "coupled", candidates=(PER_ROW, "full"), exact_q=(PER_ROW, "full")),
)
LOOP_BY_NAME = {lp.name: lp for lp in LOOPS}

HORIZON, REPLICATES, TOP = 12, 2, 3


class _Claims:
    """Log-probabilities the engine reported, each to be checked against the model's own
    forward: (path after the prompt, index in it of the token whose law it is, ids, values)."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt = prompt_ids
        self.items: list[tuple[tuple[int, ...], int, list[int], list[float]]] = []

    def add(self, path: list[int], at: int, ids: list[int], values: list[float]) -> None:
        self.items.append((tuple(path), at, list(ids), list(values)))

    def worst(self, model: torch.nn.Module) -> float:
        """max |reported − model's own| over every claim (one forward per distinct path)."""
        paths = sorted({p for p, *_ in self.items}, key=len, reverse=True)
        laws: dict[tuple[int, ...], torch.Tensor] = {}
        for p in paths:
            if not any(q[:len(p)] == p for q in laws):
                laws[p] = own_logprobs(model, self.prompt + list(p))
        worst = 0.0
        for p, at, ids, values in self.items:
            full = next(q for q in laws if q[:len(p)] == p)
            lp = laws[full][len(self.prompt) - 1 + at]
            got = torch.tensor(values, dtype=torch.float32)
            worst = max(worst, float((lp[torch.tensor(ids)] - got).abs().max()))
        return worst


def _from_trace(records: list[dict], prompt_ids: list[int], exact_q: tuple[str, ...]) -> _Claims:
    """The claims of one request's records (every candidate's): P's everywhere, Q's for ``exact_q``."""
    claims = _Claims(prompt_ids)
    heads = [r for r in records if r["type"] == "header"]
    by_cand: dict[str, list[dict]] = {h["candidate"]["policy"]: [] for h in heads}
    for r in records:
        if r["type"] != "header":
            by_cand[r.get("candidate", heads[0]["candidate"]["policy"])].append(r)
    read = {"reference": _reference_claims, "coupled": _coupled_claims, "residual": _residual_claims}
    for cand, recs in by_cand.items():
        read[heads[0]["kind"]](claims, recs, cand in exact_q)
    return claims


def _reference_claims(claims: _Claims, recs: list[dict], q_too: bool) -> None:
    steps = [r for r in recs if r["type"] == "reference_step"]
    for i in range(len(steps[0]["x_token"])):
        path = [s["x_token"][i] for s in steps]
        for t, s in enumerate(steps):
            claims.add(path, t, [path[t]], [s["x_logp"][i]])
            if q_too:
                claims.add(path, t, [path[t]], [s["x_logq"][i]])


def _top(claims: _Claims, xs: list[int], ys: list[int], t: int, lg: dict, i: int, q_too: bool) -> None:
    """One step's logit traces (row ``i``): P's top-k on P's path, Q's on Q's."""
    claims.add(xs, t, lg["p_top_token"][i], lg["p_top_logp"][i])
    if q_too:
        claims.add(ys, t, lg["q_top_token"][i], lg["q_top_logq"][i])


def _coupled_claims(claims: _Claims, recs: list[dict], q_too: bool) -> None:
    steps = [r for r in recs if r["type"] == "step"]
    for i in range(len(steps[0]["x_token"])):
        xs, ys = [s["x_token"][i] for s in steps], [s["y_token"][i] for s in steps]
        for t, s in enumerate(steps):
            _top(claims, xs, ys, t, s["logits"], i, q_too)


def _residual_claims(claims: _Claims, recs: list[dict], q_too: bool) -> None:
    """The shared path, then each branch from its branch point."""
    shared = [r for r in recs if r["type"] == "shared_step"]
    for i in range(len(shared[0]["token"])):
        z = z_of(shared, i)
        for t, s in enumerate(shared):
            _top(claims, z, z, t, s["logits"], i, q_too)
    for b in (r for r in recs if r["type"] == "branch"):
        t0 = b["branch_step"] - 1
        z = z_of(shared, b["replicate"])[:t0]
        for k in range(len(b["x_token"])):
            _top(claims, z + b["x_token"], z + b["y_token"], t0 + k, b["logits"], k, q_too)


def z_of(shared: list[dict], replicate: int) -> list[int]:
    return [s["token"][replicate] for s in shared]


def _job(loop: Loop, prompt_ids: list[int], seed: int) -> Any:
    from gen_service.engine.jobs import TraceJob

    return TraceJob(prompt_ids=prompt_ids, candidate="", candidates=list(loop.candidates),
                    seeds=[seed + i for i in range(len(loop.candidates))], kind=loop.kind, horizon=HORIZON,
                    replicates=REPLICATES, window=4 if loop.kind == "residual" else None, top_logprobs=TOP)


def run_loop(lm: Any, loop: Loop, seed: int = 3) -> float:
    """max |Δ log p| between what the engine reported along ``loop`` and the model's own
    forward over the same tokens (P's, and Q's for the candidates in ``loop.exact_q``)."""
    from gen_service.engine.facade import Engine
    from gen_service.engine.jobs import Sampling

    engine = Engine(lm)
    engine.fuse, engine.force_replay = loop.fuse, loop.replay
    if loop.kind == "generate":
        worst = 0.0
        for i, policy in enumerate(loop.candidates):
            ids = prompt(seed + i)
            items = [it for it in engine.generate(ids, policy, HORIZON, Sampling(), seed + i) if "id" in it]
            if policy in loop.exact_q or i == 0:
                claims = _Claims(ids)
                toks = [it["id"] for it in items]
                for t, it in enumerate(items):
                    claims.add(toks, t, [it["id"]], [it["logprob"]])
                worst = max(worst, claims.worst(lm.model))
        return worst
    if not loop.batched:
        ids = prompt(seed)
        records = [r for r in engine.trace(_job(loop, ids, seed)) if isinstance(r, dict)]
        return _from_trace(records, ids, loop.exact_q).worst(lm.model)
    return max(_from_trace(recs, ids, loop.exact_q).worst(lm.model) for recs, ids in _batched(engine, loop, seed))


def _batched(engine: Any, loop: Loop, seed: int) -> list[tuple[list[dict], list[int]]]:
    """Three requests of different prompt lengths and kinds decoded in one batch
    (gen_service.serving.batching), each request's records with its prompt."""
    from dataclasses import replace

    from gen_service.serving.batching import BatchEntry, BatchLoop

    class Inline:
        def __init__(self) -> None:
            self.queue: list[Any] = []

        def submit(self, fn: Any) -> None:
            self.queue.append(fn)

    class Stream:
        def __init__(self) -> None:
            self.items: list[Any] = []
            self.ended: list[Any] = []

        def stopped(self) -> bool:
            return False

        def put(self, item: Any) -> None:
            self.items.append(item)

        def end(self, exc: BaseException | None) -> None:
            self.ended.append(exc)

    class Metrics:
        def __getattr__(self, name: str) -> Any:
            return _Null()

    executor = Inline()
    batch = BatchLoop(executor, engine.runner, 8, 1 << 50, Metrics())
    prompts = [prompt(seed, PROMPT_LEN), prompt(seed + 1, PROMPT_LEN + 7), prompt(seed + 2, PROMPT_LEN - 5)]
    kinds = ["coupled", "reference", "coupled"]
    jobs = [replace(_job(replace(loop, kind=k), ids, seed + 10 * j), kind=k)
            for j, (ids, k) in enumerate(zip(prompts, kinds, strict=True))]
    streams = [Stream() for _ in jobs]
    for job, stream in zip(jobs, streams, strict=True):
        batch.submit(BatchEntry(stream, lambda c, job=job: engine.trace_steps(job, c), 0, job.replicates))
    while executor.queue:
        executor.queue.pop(0)()
    out = []
    for stream, ids in zip(streams, prompts, strict=True):
        if stream.ended != [None]:
            raise RuntimeError(f"a batched request failed: {stream.ended}")
        out.append(([r for r in stream.items if isinstance(r, dict)], ids))
    return out


class _Null:
    """A metric that records nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: self


# --------------------------------------------------------------------------- presses x families

@dataclass(frozen=True)
class Cell:
    """One press on one family (tests/test_presses_families.py, docs/presses-by-family.md).

    ``outcome``: ``equals kvpress`` (kvpress's own pipeline runs it on this model and kvdiv's
    greedy candidate tokens are the pipeline's), ``runs`` (kvdiv runs it; kvpress's pipeline
    is not comparable here: it also compresses windowed layers, or it fails), ``refused``
    (kvdiv refuses it on this model by design; run anyway, it fails) or ``FAILS`` (a bug:
    neither runs nor refused). ``detail``: the refusal, the kvpress failure, or the difference.
    """

    press: str
    policy: str
    outcome: str
    detail: str = ""


#: greedy tokens compared with kvpress's pipeline, after a question of QUESTION_LEN tokens
PIPELINE_HORIZON, QUESTION_LEN = 8, 6


def press_policies(num_layers: int) -> list[tuple[str, str]]:
    """(press class, policy id) for every press of the table that runs without an artifact."""
    from gen_service.presses.table import PRESSES

    out = []
    for p in PRESSES:
        if not p.kinds or p.artifact is not None:
            continue
        policy = p.example
        if p.name == "CAMPress":   # a budget the prompt passes: it evicts within the few steps run
            policy = "kvpress:CAMPress(KnormPress)#24:compression_interval=2"
        if p.name == "PerLayerCompressionPress":   # one ratio per layer
            policy = ("kvpress:PerLayerCompressionPress(KnormPress):compression_ratios="
                      + ";".join(["0.3", "0.7"] * num_layers)[: 4 * num_layers - 1])
        out.append((p.name, policy))
    return out


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"


def _run(engine: Any, policy: str, ids: list[int]) -> None:
    from gen_service.engine.jobs import TraceJob

    for _ in engine.trace(TraceJob(prompt_ids=ids, candidate=policy, kind="coupled", horizon=3, replicates=1, seed=0)):
        pass


def _kvdiv_greedy(engine: Any, policy: str, ids: list[int], question: list[int]) -> list[int]:
    from gen_service.engine.coupling import Sampling
    from gen_service.engine.jobs import TraceJob

    job = TraceJob(prompt_ids=ids, question_ids=question, candidate=policy, horizon=PIPELINE_HORIZON, replicates=1,
                   sampling=Sampling(do_sample=False), seed=0)
    torch.manual_seed(0)   # presses drawing from the global generator (LeverageScore) draw as kvpress's run
    return [r["y_token"][0] for r in engine.trace(job) if isinstance(r, dict) and r["type"] == "step"]


def kvpress_greedy(model: torch.nn.Module, press: Any, ids: list[int], question: list[int]) -> list[int]:
    """kvpress's own ``kv-press-text-generation`` pipeline (its ``_forward``: prefill under
    the press, then the question and greedy decoding), with kvpress's own window attention
    (not kvdiv's: gen_service.presses.rotary); the answer's token ids."""
    from unittest import mock

    import kvpress  # noqa: F401  (registers the pipeline)
    from kvpress import SnapKVPress
    from kvpress.pipeline import KVPressTextGenerationPipeline

    from gen_service.presses.rotary import kvpress_window_attention

    class Ids:   # the pipeline decodes its answer: keep the ids
        def decode(self, ids: Any, **_: Any) -> str:
            return ",".join(str(int(i)) for i in ids)

    pipe = KVPressTextGenerationPipeline.__new__(KVPressTextGenerationPipeline)
    pipe.model, pipe.tokenizer = model, Ids()
    tensors = {"context_ids": torch.tensor([ids]), "questions_ids": [torch.tensor([question])]}
    torch.manual_seed(0)
    with mock.patch.object(SnapKVPress, "compute_window_attention", staticmethod(kvpress_window_attention())), \
            torch.inference_mode():
        answer = pipe._forward(tensors, max_new_tokens=PIPELINE_HORIZON, press=press)[0]
    return [int(t) for t in answer.split(",")]


def press_cells(lm: Any) -> list[Cell]:
    """Every press of the table on ``lm`` (a conformance family's model, its config's
    ``_name_or_path`` a folder holding its tokenizer: KVzip loads it from there), each
    over a prompt longer than every window: refused by design, run, and compared with
    kvpress's own pipeline where that compresses the same layers kvdiv does (a model
    without windowed layers)."""
    from dataclasses import replace
    from unittest import mock

    from gen_service.engine.facade import Engine
    from gen_service.errors import PolicyError
    from gen_service.presses.registry import ModelInfo

    engine = Engine(lm)
    info = ModelInfo.of(lm)
    ids, question = prompt(0), prompt(1, n=QUESTION_LEN)
    cells = []
    for name, policy in press_policies(info.num_layers):
        try:
            engine.registry.build(policy, info)
        except PolicyError as exc:
            if not exc.permanent:
                cells.append(Cell(name, policy, "FAILS", f"not built: {exc}"))
                continue
            try:   # a refusal by design: run anyway, it must fail
                with mock.patch("gen_service.presses.registry.refusal", lambda *a, **k: None):
                    _run(engine, policy, ids)
                cells.append(Cell(name, policy, "FAILS", f"refused, yet it runs: {exc}"))
            except Exception:
                cells.append(Cell(name, policy, "refused", str(exc).split(": ", 1)[1]))
            continue
        try:
            _run(engine, policy, ids)
        except Exception as exc:
            cells.append(Cell(name, policy, "FAILS", _first_line(exc)))
            continue
        if info.features is not None and info.features.windowed:
            cells.append(Cell(name, policy, "runs", "kvpress compresses the windowed layers too: not compared"))
            continue
        press = engine.registry.build(policy, replace(info, features=None)).plan(len(ids)).press
        try:
            want = kvpress_greedy(lm.model, press, ids, question)
        except Exception as exc:
            cells.append(Cell(name, policy, "runs", f"kvpress's pipeline fails: {_first_line(exc)}"))
            continue
        got = _kvdiv_greedy(engine, policy, ids, question)
        same = got == want
        cells.append(Cell(name, policy, "equals kvpress" if same else "FAILS",
                          "" if same else f"greedy tokens differ from kvpress's pipeline: {got} vs {want}"))
    return cells

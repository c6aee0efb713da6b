"""Every EOS id of a model ends a generation and is absorbing (issue 21 item 1).

Tiny random-initialised models with the structure of real configs, written here as
config dictionaries and saved as local model directories (config.json,
generation_config.json, a byte-level tokenizer built with ``tokenizers``): no
weights, no hub. Llama-3.1-8B-Instruct lists three EOS ids (128001 ``<|end_of_text|>``,
128008 ``<|eom_id|>``, 128009 ``<|eot_id|>``) and ends chat turns with the last;
here they sit at 257, 264 and 265 above the 256 byte tokens, with the same offsets
from ``<|begin_of_text|>`` (256 here, 128000 there).
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from protocols import assemble, open_traces, save_traces, validate

pytestmark = pytest.mark.service

BOS, END_OF_TEXT, EOM, EOT = 256, 257, 264, 265          # 128000, 128001, 128008, 128009 in Llama-3.1
LLAMA_EOS = [END_OF_TEXT, EOM, EOT]

# Llama-3.1-8B-Instruct's config.json, scaled down: 32 heads / 8 KV heads -> 8 / 2 (GQA 4:1),
# hidden 4096 -> 64, 32 layers -> 2, vocab 128256 -> 272; rope llama3 scaling, untied head.
LLAMA31_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": BOS, "eos_token_id": LLAMA_EOS, "hidden_act": "silu", "hidden_size": 64, "head_dim": 8,
    "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 2048,
    "num_attention_heads": 8, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 256, "rope_type": "llama3"},
    "use_cache": True, "vocab_size": 272,
}
LLAMA31_GENERATION = {"bos_token_id": BOS, "eos_token_id": LLAMA_EOS, "do_sample": True, "temperature": 0.6,
                      "top_p": 0.9}
LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(4)] \
    + ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
    " + m['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5-7B-Instruct's, scaled down: 28 heads / 4 KV heads -> 7 / 1, q/k/v biases (Qwen2 always
# has them), <|im_end|> the EOS, generation config [<|im_end|>, <|endoftext|>].
ENDOFTEXT, IM_START, IM_END = 256, 257, 258                 # 151643, 151644, 151645 in Qwen2.5
QWEN25_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
    "bos_token_id": ENDOFTEXT, "eos_token_id": IM_END, "hidden_act": "silu", "hidden_size": 56,
    "initializer_range": 0.02, "intermediate_size": 112, "max_position_embeddings": 2048, "max_window_layers": 2,
    "num_attention_heads": 7, "num_hidden_layers": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "sliding_window": 2048, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 264,
}
QWEN25_GENERATION = {"bos_token_id": ENDOFTEXT, "pad_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT],
                     "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

PROMPT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 2


def _tokenizer(specials: list[str], **kw):
    """A byte-level BPE without merges: the 256 byte symbols, then ``specials`` from id 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=2048, **kw)


def _save(path: Path, config: dict, generation: dict, tokenizer, shape=None) -> Path:
    """Write a random-initialised model of ``config`` (``shape`` edits its weights) to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.for_model(**config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
    if shape is not None:
        with torch.no_grad():
            shape(model)
    model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _context_free(model, logits: dict[int, float]) -> None:
    """Make the next-token law the same after every history: the residual stream is the
    (constant) embedding, so the head sees one hidden state, all ones after the norm;
    ``logits`` sets the head's rows (every other token gets logit 0)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.model.embed_tokens.weight.fill_(1.0)
    head = model.lm_head.weight
    head.zero_()
    for tid, value in logits.items():
        head[tid] = value / head.shape[1]


def _llama_tokenizer():
    return _tokenizer(LLAMA31_SPECIALS, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                      chat_template=LLAMA3_TEMPLATE)


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama31")
    tok = _llama_tokenizer()
    # "certain": <|eot_id|> (the third EOS id) has logit 64, every other token 0
    certain = _save(root / "certain", LLAMA31_CONFIG, LLAMA31_GENERATION, tok,
                    lambda m: _context_free(m, {EOT: 64.0}))
    # "mixed": <|eom_id|> and <|eot_id|> a third each, the other 270 tokens the last third
    mixed = _save(root / "mixed", LLAMA31_CONFIG, LLAMA31_GENERATION, tok,
                  lambda m: _context_free(m, {EOM: math.log(270), EOT: math.log(270)}))
    return {"certain": certain, "mixed": mixed, "random": _save(root / "random", LLAMA31_CONFIG,
                                                                  LLAMA31_GENERATION, tok)}


def _client(model_dir: Path, **kw):
    from starlette.testclient import TestClient

    from gen_service.api.cli import build_service

    app, _ = build_service(str(model_dir), max_new_tokens=16, max_replicates=32, eviction="snapkv@0.5",
                           dtype="float32", device="cpu", **kw)
    return TestClient(app)


@pytest.fixture(scope="module")
def certain(llama_dirs) -> Iterator:
    with _client(llama_dirs["certain"]) as c:
        yield c


@pytest.fixture(scope="module")
def mixed(llama_dirs) -> Iterator:
    with _client(llama_dirs["mixed"]) as c:
        yield c


def _trace(client, body: dict) -> list[str]:
    r = client.post("/v1/traces", json=body)
    assert r.status_code == 200, r.text
    return [line for line in r.text.splitlines() if line]


def test_loader_keeps_every_eos_id(llama_dirs) -> None:
    from gen_service.models.loading import load_model

    lm = load_model(str(llama_dirs["random"]), device="cpu", dtype="float32")
    assert lm.eos_token_ids == tuple(LLAMA_EOS) and lm.eos_token_id == END_OF_TEXT
    attn = lm.model.model.layers[0].self_attn
    assert attn.k_proj.out_features == 2 * 8 and attn.q_proj.out_features == 8 * 8    # GQA 8 / 2
    assert lm.model.config.rope_scaling["rope_type"] == "llama3"


def test_loader_falls_back_to_the_tokenizer_eos() -> None:
    from types import SimpleNamespace

    from gen_service.models.loading import _eos_from

    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    assert _eos_from(model, SimpleNamespace(eos_token_id=5)) == (5,)
    model.generation_config.eos_token_id = []
    assert _eos_from(model, SimpleNamespace(eos_token_id=None)) == ()
    model.generation_config.eos_token_id = [9, 2, 9]
    assert _eos_from(model, SimpleNamespace(eos_token_id=5)) == (9, 2)


def test_generate_stops_at_a_non_first_eos(certain) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True, "do_sample": True, "seed": 1}}
    out = certain.post("/generate", json=body).json()
    det = out["details"]
    assert det["finish_reason"] == "eos_token" and det["generated_tokens"] == 1
    assert [t["id"] for t in det["tokens"]] == [EOT]


def test_generate_stream_stops_at_a_non_first_eos(certain) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "seed": 1}}
    with certain.stream("POST", "/generate_stream", json=body) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 1 and events[-1]["token"]["id"] == EOT
    assert events[-1]["details"]["finish_reason"] == "eos_token"


def test_chat_completions_stop_at_eot(certain) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "seed": 2}
    choice = certain.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""   # EOS is not text
    chunks = certain.post("/v1/chat/completions", json={**body, "stream": True}).text
    events = [json.loads(x[5:]) for x in chunks.splitlines() if x.startswith("data:") and "[DONE]" not in x]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"


def test_info_and_trace_header_list_every_eos_id(certain) -> None:
    kv = certain.get("/info").json()["kvdiv"]
    assert kv["eos_token_ids"] == LLAMA_EOS and kv["eos_token_id"] == END_OF_TEXT
    lines = _trace(certain, {"inputs": PROMPT, "candidate": "snapkv@0.5", "replicates": 3,
                             "parameters": {"max_new_tokens": 4, "seed": 3}})
    header = json.loads(lines[0])
    assert header["eos_token_ids"] == LLAMA_EOS and header["eos_token_id"] == END_OF_TEXT
    ds = assemble(lines, doc="d")
    assert list(ds.attrs["eos_token_ids"]) == LLAMA_EOS and ds.attrs["eos_token_id"] == END_OF_TEXT
    assert (ds.x_token.values == EOT).all() and (ds.y_token.values == EOT).all() and (ds.tv.values == 0).all()


def test_coupled_trace_absorbs_on_each_eos_id(mixed, tmp_path) -> None:
    """Rows end on <|eom_id|> or <|eot_id|> (a third each per step) and keep that id:
    without absorption the next step would be either of them or another token."""
    import divstats as dv

    lines = _trace(mixed, {"inputs": PROMPT, "candidate": "snapkv@0.5", "replicates": 24,
                           "parameters": {"max_new_tokens": 8, "seed": 5}})
    ds = assemble(lines, doc="d")
    x = ds.x_token.values[0, 0]                                  # (replicate, step)
    ended_on = {}
    for r, row in enumerate(x):
        hits = np.flatnonzero(np.isin(row, LLAMA_EOS))
        assert hits.size, f"replicate {r} never ended: {row}"
        ended_on[r] = row[hits[0]]
        assert (row[hits[0]:] == row[hits[0]]).all(), f"replicate {r} left EOS {row[hits[0]]}: {row}"
    assert set(ended_on.values()) == {EOM, EOT}                  # both non-first ids occur
    assert (ds.x_token.values == ds.y_token.values).all()        # a context-free model: P = Q
    path = save_traces(ds, tmp_path / "t.nc")
    back = open_traces(path)
    validate(back)
    assert list(np.atleast_1d(back.attrs["eos_token_ids"])) == LLAMA_EOS
    est = dv.estimate(back, window=2)
    assert float(est.occurrence.values.max()) == 0.0 and float(est.tail_capacity.values.max()) == 0.0


def test_residual_trace_absorbs_on_each_eos_id(mixed) -> None:
    lines = _trace(mixed, {"inputs": PROMPT, "candidate": "snapkv@0.5", "kind": "residual", "replicates": 8,
                           "window": 3, "parameters": {"max_new_tokens": 6, "seed": 6}})
    ds = validate(assemble(lines, doc="d"))
    z = ds.shared_token.values[0, 0]
    for row in z:
        hits = np.flatnonzero(np.isin(row, LLAMA_EOS))
        assert hits.size and (row[hits[0]:] == row[hits[0]]).all()


def _eos_leaning(model) -> None:
    """Context-dependent laws with a steady pull towards <|eom_id|> and <|eot_id|>: hidden
    dim 0 is a constant 100 that no layer writes to, and those two head rows read it."""
    model.model.embed_tokens.weight[:, 0] = 100.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0] = 0.0
        layer.mlp.down_proj.weight[0] = 0.0
    model.lm_head.weight[EOM, 0] = 0.6
    model.lm_head.weight[EOT, 0] = 0.6


@pytest.fixture(scope="module")
def leaning(tmp_path_factory) -> Iterator:
    d = _save(tmp_path_factory.mktemp("llama31") / "leaning", {**LLAMA31_CONFIG, "initializer_range": 0.1},
              LLAMA31_GENERATION, _llama_tokenizer(), _eos_leaning)
    with _client(d) as c:
        yield c


@pytest.mark.parametrize("candidate", ["snapkv@0.5", "quant:kivi@4:residual_length=2,group_size=4"])
def test_residual_branches_absorb_on_each_eos_id(leaning, candidate: str) -> None:
    """Branches (prefix branches for a prefill press, replayed ones for a quantized cache)
    end on either non-first id, each keeping its own; validation checks the rule and TV 0
    once both branches ended on the same id."""
    lines = _trace(leaning, {"inputs": PROMPT, "candidate": candidate, "kind": "residual", "replicates": 32,
                             "window": 6, "parameters": {"max_new_tokens": 8, "seed": 5}})
    ds = validate(assemble(lines, doc="d"))
    bs = ds.branch_step.values[0, 0]
    ends = set()
    for bx, by in zip(ds.branch_x_token.values[0, 0][bs > 0], ds.branch_y_token.values[0, 0][bs > 0], strict=True):
        for row in (bx, by):
            row = row[row >= 0]
            hits = np.flatnonzero(np.isin(row, LLAMA_EOS))
            if hits.size:
                assert (row[hits[0]:] == row[hits[0]]).all(), row
                ends.add(int(row[hits[0]]))
    assert {EOM, EOT} <= ends


# --------------------------------------------------------------------------- Qwen2.5


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    from gen_service.models.loading import CHATML_TEMPLATE

    tok = _tokenizer(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                     chat_template=CHATML_TEMPLATE)
    return _save(tmp_path_factory.mktemp("qwen25") / "m", QWEN25_CONFIG, QWEN25_GENERATION, tok)


def test_qwen_shaped_model_loads_and_traces(qwen_dir) -> None:
    from gen_service.models.loading import load_model

    lm = load_model(str(qwen_dir), device="cpu", dtype="float32")
    attn = lm.model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert attn.k_proj.out_features == 8 and attn.q_proj.out_features == 56            # GQA 7 / 1, head_dim 8
    assert lm.eos_token_ids == (IM_END, ENDOFTEXT) and lm.eos_token_id == IM_END
    with _client(qwen_dir) as c:
        assert c.get("/info").json()["kvdiv"]["eos_token_ids"] == [IM_END, ENDOFTEXT]
        for kind in ("coupled", "residual"):
            window = {"window": 3} if kind == "residual" else {}
            lines = _trace(c, {"messages": [{"role": "user", "content": PROMPT}], "candidate": "snapkv@0.5",
                               "kind": kind, "replicates": 4, **window, "parameters": {"max_new_tokens": 6,
                                                                                         "seed": 7}})
            ds = validate(assemble(lines, doc="q"))
            assert list(ds.attrs["eos_token_ids"]) == [IM_END, ENDOFTEXT] and ds.attrs["kind"] == kind


def test_a_record_with_one_eos_id_means_that_set() -> None:
    from gen_service.models.loading import LoadedModel

    one = LoadedModel(model=torch.nn.Identity(), tokenizer=None, name="m", eos_token_id=2, vocab_size=8,
                      max_context=16, device=torch.device("cpu"), dtype=torch.float32)
    assert one.eos_token_ids == (2,)
    many = LoadedModel(model=torch.nn.Identity(), tokenizer=None, name="m", eos_token_id=None, vocab_size=8,
                       max_context=16, device=torch.device("cpu"), dtype=torch.float32, eos_token_ids=(5, 7))
    assert many.eos_token_id == 5

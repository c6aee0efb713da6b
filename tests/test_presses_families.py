"""Every press on every family, or a refusal that says why (issue 41).

For each conformance family (tests/conformance_models.py: tiny random models, every
window shorter than the prompt; Phi-3 also with partial rotary and no window) and each
press of the table that runs without an artifact: kvdiv refuses it on that model by
design (and then, run anyway, it really fails), or it runs; where kvpress's own pipeline
compresses the same layers kvdiv does (a model without windowed layers) and runs the
press, kvdiv's greedy candidate tokens are the pipeline's. docs/presses-by-family.md is
this matrix (benchmarks/conformance_table.py --presses).

Then the window-attention fix (gen_service/presses/rotary.py): bit for bit kvpress's on
full-rotary models, the model's own attention weights on partial rotary.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

from pathlib import Path

import pytest
import torch
from conformance_models import BY_NAME, FAMILIES, PROMPT_LEN, build, loaded, press_cells, prompt

from gen_service.presses.families import ModelFeatures
from gen_service.presses.registry import ModelInfo, PolicyRegistry
from gen_service.presses.rotary import kvpress_window_attention, model_rotary_window_attention, window_attention

#: families whose every layer may be compressed: kvpress's pipeline is the reference there
UNWINDOWED = ("llama", "olmo2", "phi3_partial")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The byte tokenizer saved where KVzip looks for the checkpoint's (``config.name_or_path``)."""
    from gen_service.models.loading import byte_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    byte_tokenizer().save_pretrained(path)
    return path


def _lm(name: str, tokenizer_dir: Path):
    lm = loaded(BY_NAME[name])
    lm.model.config._name_or_path = str(tokenizer_dir)
    return lm


@pytest.mark.parametrize("family", [pytest.param(f.name, marks=() if f.name in ("llama", "phi3_partial", "gpt_oss")
                                                 else pytest.mark.slow) for f in FAMILIES])
def test_every_press_runs_or_is_refused_by_design(family: str, tokenizer_dir: Path) -> None:
    cells = press_cells(_lm(family, tokenizer_dir))
    bad = [f"{c.press} ({c.policy}): {c.detail}" for c in cells if c.outcome == "FAILS"]
    assert not bad, "\n".join(bad)
    for c in (c for c in cells if c.outcome == "refused"):
        assert c.press in c.detail or "cannot run" in c.detail, c
        assert "it would need" in c.detail, c
    if family in UNWINDOWED:   # the reference runs most presses here, and kvdiv's tokens are its
        assert sum(c.outcome == "equals kvpress" for c in cells) >= 12, cells


def test_partial_rotary_before_and_after(tokenizer_dir: Path) -> None:
    """Phi-3 with partial rotary: kvpress's own window attention fails there (the issue's
    error), kvdiv's runs every window-attention press; the presses rotating queries or
    keys themselves are refused, naming partial rotary."""
    cells = {c.press: c for c in press_cells(_lm("phi3_partial", tokenizer_dir))}
    for press in ("SnapKVPress", "PyramidKVPress", "AdaKVPress", "TOVAPress", "SimLayerKVPress"):
        assert cells[press].outcome == "runs" and "must match the size" in cells[press].detail, cells[press]
    for press in ("ThinKPress", "KeyRerotationPress", "FinchPress", "ExpectedAttentionPress", "KVzipPress"):
        assert cells[press].outcome == "refused" and "partial rotary" in cells[press].detail, cells[press]
    assert cells["KnormPress"].outcome == "equals kvpress"


def _layer_inputs(model: torch.nn.Module, layer: int, ids: list[int]) -> dict:
    """What kvpress's hook sees at ``layer``: its input hidden states, position embeddings, cached keys."""
    from transformers import DynamicCache

    seen: dict = {}

    def hook(module, args, kwargs):
        seen["hidden_states"] = kwargs["hidden_states"]
        seen["position_embeddings"] = kwargs["position_embeddings"]

    attn = model.model.layers[layer].self_attn
    handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                  output_attentions=model.config._attn_implementation == "eager")
    finally:
        handle.remove()
    seen["keys"] = cache.layers[layer].keys
    seen["module"] = attn
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "gemma3_text"])
def test_window_attention_with_the_models_rotary_is_kvpress_bit_for_bit(family: str) -> None:
    """Full-rotary models with Llama's rotation: rotating the queries with the model's own
    apply_rotary_pos_emb gives kvpress's window attention exactly (equal tensors, not close
    ones). (Cohere 2 rotates interleaved pairs, not halves: there kvdiv keeps kvpress's
    function as it is, its cos/sin being as wide as the head.)"""
    from gen_service.presses.layered import compressible_layers

    model = build(BY_NAME[family])
    layer = compressible_layers(model)[0]
    s = _layer_inputs(model, layer, prompt(0))
    args = (s["module"], s["hidden_states"], s["keys"], 16, s["position_embeddings"])
    want = kvpress_window_attention()(*args)
    assert torch.equal(model_rotary_window_attention(*args), want)
    assert torch.equal(window_attention(*args), want)


def test_window_attention_on_partial_rotary_is_the_models_own_attention() -> None:
    """Phi-3 with half of each head rotated: kvpress's function fails; kvdiv's gives the
    attention weights the model's own (eager) attention computes for those queries."""
    lm = build(BY_NAME["phi3_partial"])
    lm.config._attn_implementation = "eager"
    ids, w = prompt(0), 16
    s = _layer_inputs(lm, 1, ids)
    args = (s["module"], s["hidden_states"], s["keys"], w, s["position_embeddings"])
    with pytest.raises(RuntimeError, match="must match the size"):
        kvpress_window_attention()(*args)
    with torch.no_grad():
        own = lm(input_ids=torch.tensor([ids]), output_attentions=True).attentions[1]
    got = window_attention(*args)
    assert got.shape == (1, 4, w, PROMPT_LEN - w)
    assert torch.allclose(got, own[:, :, -w:, :-w], atol=1e-6)


def test_refusals_name_the_feature_per_model() -> None:
    reg = PolicyRegistry(entry_points_group=None)
    refused = {f: reg.refusals(ModelInfo.of(loaded(BY_NAME[f]))) for f in ("llama", "phi3_partial", "gemma2")}
    assert refused["llama"] == {}
    assert refused["phi3_partial"]["ThinKPress"].feature.startswith("partial rotary (8 of 16")
    assert "SnapKVPress" not in refused["phi3_partial"]
    assert "eager attention" in refused["gemma2"]["AdaKVPress"].feature
    features = ModelFeatures.of(build(BY_NAME["gpt_oss"]))
    assert (features.cos_width, features.rotary_dim, features.head_dim) == (8, 16, 16)

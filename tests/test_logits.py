"""Logits in float32 whatever the weights' dtype (gen_service/models/float_head.py), and weights
loaded straight onto the device in the serving dtype (gen_service/models/loading.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gen_service.models.float_head as head_module
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.models.float_head import CHUNK_BYTES, extra_bytes, head32, logits
from gen_service.models.loading import byte_tokenizer, load_model, pretrained_kwargs, tiny_model

IDS = [1, 40, 77, 3, 100, 200, 13, 9, 250, 31, 64, 2, 120, 18]


@pytest.fixture(scope="module")
def fp32():
    return load_model("tiny:llama", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def bf16():
    return load_model("tiny:llama", device="cpu", dtype="bfloat16")


def _prenorm(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the final norm's input, the model's own logits) of one forward, bf16 as the model computes them."""
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, a, o: seen.setdefault("h", a[0]))
    try:
        with torch.inference_mode():
            out = model(**inputs).logits
    finally:
        hook.remove()
    return seen["h"], out


def _reference(model: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The last layer (RMSNorm + head) of the same weights in float64."""
    norm, head = model.model.norm, model.lm_head
    x = h.double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()
    return x @ head.weight.double().T


def test_fp32_model_logits_are_the_models_own(fp32):
    """In the "rows" layout (CUDA's) the model's own operations, bit for bit; in the CPU's
    "columns" layout the same products within float32 rounding."""
    from dataclasses import replace

    model, x = fp32.model, torch.tensor([IDS])
    made = head32(model)
    assert made.layout == head_module.layout_for("float32", model.device)
    try:
        with torch.inference_mode():
            for layout in ("rows", "columns"):
                head_module._HEADS[model] = replace(made, layout=layout)
                for keep in (0, 1, 3):
                    got, want = logits(model, keep, input_ids=x), model(input_ids=x, logits_to_keep=keep).logits
                    if layout == "rows":
                        assert torch.equal(got, want)
                    else:
                        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    finally:
        head_module._HEADS[model] = made
    assert extra_bytes(model) == 0
    assert head32(model).weight.data_ptr() == model.lm_head.weight.data_ptr()   # no copy
    assert head32(model).norm is None


def test_the_columns_head_gives_a_row_the_same_bits_alone_and_among_300(fp32):
    """The CPU's "columns" product in blocks of COLUMN_BLOCK rows, each padded to
    MIN_COLUMNS: a row's logits are the same bits alone, at a block's edge or past it,
    and within float32 rounding of ``F.linear``."""
    from dataclasses import replace

    head = replace(head32(fp32.model), layout="columns")
    x = torch.randn(300, head.weight.shape[1], generator=torch.Generator().manual_seed(0)) * 3
    together = head_module.project(head, x)
    assert head_module.COLUMN_BLOCK < 300
    for i in (0, 17, head_module.COLUMN_BLOCK - 1, head_module.COLUMN_BLOCK, 299):
        assert torch.equal(head_module.project(head, x[i:i + 1]), together[i:i + 1]), i
    want = F.linear(x, head.weight)
    assert (together - want).abs().max() <= 1e-6 * want.abs().max()


def test_bf16_logits_are_the_float32_last_layer_of_the_same_weights(bf16):
    model, x = bf16.model, torch.tensor([IDS])
    h, own = _prenorm(model, input_ids=x)
    ref = _reference(model, h)
    with torch.inference_mode():
        ours = logits(model, 0, input_ids=x)
    assert ours.dtype == torch.float32 and h.dtype == torch.bfloat16
    err = (ours.double() - ref).abs().max().item()
    bf16_err = (own.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1e-5 * scale                     # float32 rounding
    assert bf16_err > 100 * err                    # the model's own bf16 logits are rounded
    # TV from the rounded logits is not zero; from ours it is float32 noise
    p = ref.softmax(-1)
    assert 0.5 * (own.double().softmax(-1) - p).abs().sum(-1).max() > 1e-4
    assert 0.5 * (ours.double().softmax(-1) - p).abs().sum(-1).max() < 1e-6


def test_bf16_head_holds_no_float32_copy_and_is_counted(bf16):
    model = bf16.model
    made = head32(model)
    assert made is head32(model)                   # cached, built when the model was loaded
    V, H = model.lm_head.weight.shape
    assert made.weight.data_ptr() == model.lm_head.weight.data_ptr() and made.weight.dtype == torch.bfloat16
    assert made.method == "chunked"                # CPU: no bf16 GEMM with float32 output
    rows = min(V, CHUNK_BYTES // (4 * H))
    assert made.buffer.shape == (rows, H)
    assert extra_bytes(model) == rows * H * 4 + H * 4  # the chunk buffer and the final norm's weight


def _fake_mm(real):
    """``torch.mm`` with ``out_dtype`` as a GEMM with float32 accumulation computes it
    (float32 products of the bf16 inputs): the split head's CUDA call, on CPU."""
    def mm(a, b, *args, out_dtype=None, **kw):
        return real(a, b, *args, **kw) if out_dtype is None else real(a.float(), b.float()).to(out_dtype)
    return mm


@pytest.mark.parametrize("chunk_rows", [7, 1000, None])
def test_chunked_and_split_heads_equal_the_float32_product_of_a_128k_head(chunk_rows, monkeypatch):
    """A random bf16 head of Llama's vocabulary (narrow, to stay fast): the chunked cast
    with the default buffer is the float32 copy's product bit for bit on CPU, and with
    any chunk size (the last one ragged) within float32 rounding of it (the GEMM kernel
    may sum in another order for another width); the split GEMM (emulated) is within
    float32 rounding of float64."""
    gen = torch.Generator().manual_seed(0)
    V, H = 128256, 64
    w = (torch.randn(V, H, generator=gen) * 0.3).bfloat16()
    x = torch.randn(5, H, generator=gen) * 3
    ref32 = F.linear(x, w.float())
    ref64 = x.double() @ w.double().T
    fp32_err = (ref32.double() - ref64).abs().max()
    if chunk_rows is None:
        assert torch.equal(head_module._chunked(x, w, head_module._buffer(w)), ref32)
        columns = head_module._chunked(x, w, head_module._buffer(w), "columns")
        assert (columns.double() - ref64).abs().max() <= 2 * fp32_err
    else:
        assert (head_module._chunked(x, w, torch.empty(chunk_rows, H)).double() - ref64).abs().max() <= 2 * fp32_err
    monkeypatch.setattr(torch, "mm", _fake_mm(torch.mm))
    split = head_module._split(x, w)
    scale = ref64.abs().max().item()
    assert (split.double() - ref64).abs().max() <= 4 * fp32_err + 1e-7 * scale
    bf = F.linear(x.bfloat16(), w).float()
    assert (bf.double() - ref64).abs().max() > 100 * (split.double() - ref64).abs().max()


def test_the_split_head_is_chosen_only_where_it_agrees(monkeypatch):
    """The choice at load: split where torch.mm has out_dtype on the device and its result
    agrees with the chunked product; the chunked head, logged, where it fails or differs."""
    w = (torch.randn(300, 32) * 0.3).bfloat16()
    assert not head_module._splittable(w)                       # CPU weights never split
    monkeypatch.setattr(head_module, "_splittable", lambda w: True)
    real = torch.mm
    monkeypatch.setattr(torch, "mm", _fake_mm(real))
    assert head_module._choose(w, None) == ("split", None)
    x = torch.randn(3, 2, 32)
    head = head_module.Head32(w, None, None, (), 0, "split")
    assert torch.allclose(head_module.project(head, x), F.linear(x, w.float()), atol=1e-5)
    monkeypatch.setattr(torch, "mm", real)                      # no out_dtype: the call raises
    method, buf = head_module._choose(w, None)
    assert method == "chunked" and buf.dtype == torch.float32
    monkeypatch.setattr(torch, "mm", lambda a, b, *r, out_dtype=None, **k: real(a.float(), b.float()) + 1 if
                        out_dtype else real(a, b, *r, **k))     # runs but wrong
    assert head_module._choose(w, None)[0] == "chunked"


def test_engine_paths_give_float32_logits_in_bf16(bf16):
    """Prefill, a decoding step, stacked and fused forwards and prompt log-probabilities:
    all from the float32 last layer."""
    engine = Engine(bf16)
    reg = engine.registry
    model, x = bf16.model, torch.tensor([IDS])
    h, _ = _prenorm(model, input_ids=x)
    ref = _reference(model, h)[0]
    pre = engine.prefill(reg.build("full"), IDS)
    assert pre.logits.dtype == torch.float32
    assert (pre.logits[0].double() - ref[-1]).abs().max() <= 1e-5 * ref.abs().max()
    lps = engine.prompt_logprobs(IDS)
    want = ref.log_softmax(-1)[:-1].gather(-1, torch.tensor(IDS[1:])[:, None]).squeeze(-1)
    assert max(abs(a - b) for a, b in zip(lps[1:], want.tolist(), strict=True)) < 1e-5
    # full vs full on bf16 weights: exactly 0 with P's and Q's forwards apart; fused into
    # one batch, float32 rounding (as for a float32 model, docs/service.md)
    for fuse, tol in (("off", 0.0), ("on", 1e-5)):
        job = TraceJob(prompt_ids=IDS, candidate="full", horizon=4, replicates=3, seed=0, sampling=Sampling())
        engine.fuse = fuse
        recs = [r for r in engine.trace(job) if r.get("type") == "step"]
        assert recs and all(tv <= tol for r in recs for tv in r["tv"])
    job = TraceJob(prompt_ids=IDS, candidate="snapkv@0.5", candidates=["snapkv@0.5", "streaming@0.5"], horizon=3,
                   replicates=2, seed=0, seeds=[1, 2], sampling=Sampling())   # stacked candidates' forwards
    assert any(r.get("type") == "step" for r in engine.trace(job))


def test_pretrained_weights_go_straight_to_the_device_in_the_serving_dtype(tmp_path, fp32):
    kw = pretrained_kwargs(torch.device("cpu"), torch.bfloat16)
    assert kw["device_map"] == torch.device("cpu") and kw["dtype"] is torch.bfloat16
    tiny_model("llama").save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), device="cpu", dtype="bfloat16")
    assert {(p.dtype, p.device.type) for p in lm.model.parameters()} == {(torch.bfloat16, "cpu")}
    assert lm.dtype is torch.bfloat16 and head32(lm.model).method == "chunked"
    # CPU float32 as before: the same weights bit for bit as the model built in memory
    again = load_model(str(tmp_path), device="cpu", dtype="float32")
    for (name, a), b in zip(again.model.state_dict().items(), fp32.model.state_dict().values(), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_bf16_head_gives_float32_logits_without_a_copy():
    """On the device: the method chosen at load (split where torch.mm takes out_dtype),
    no float32 copy held, logits within float32 rounding of the float64 product."""
    lm = load_model("random:llama-1b", device="cuda", dtype="bfloat16")
    model, x = lm.model, torch.tensor([IDS], device="cuda")
    made = head32(model)
    assert made.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert made.method == ("split" if "dtype" in torch.ops.aten.mm.overloads() else "chunked"), made.method
    assert extra_bytes(model) <= CHUNK_BYTES + 4 * model.config.hidden_size
    h, _ = _prenorm(model, input_ids=x)
    ref = _reference(model, h)
    with torch.inference_mode():
        ours = logits(model, 0, input_ids=x)
    assert (ours.double() - ref).abs().max() <= 1e-5 * ref.abs().max()

"""The start-up self-check (gen_service/serving/self_check.py): P's decoding against the model's own
forward, the tokenizer against the checkpoint's; a mismatch refuses the start."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from gen_service.serving.self_check import SelfCheckFailed, model_logprobs, windows_by_type


@pytest.fixture(scope="module")
def tiny_service():
    from gen_service.api.cli import build_service

    return build_service("tiny:llama", max_new_tokens=64)


def test_tiny_model_passes_and_info_reports_it(tiny_service) -> None:
    from starlette.testclient import TestClient

    app, service = tiny_service
    check = service.self_check
    assert check.passed and check.max_error <= check.tolerance == 1e-3
    assert check.paths == 8 and check.steps == 16 and check.seconds > 0
    info = TestClient(app).get("/info").json()["kvdiv"]["self_check"]
    assert info["passed"] and not info["skipped"] and info["max_error"] == check.max_error
    assert info["tokenizer"]["first_difference"] is None


def test_passes_one_request_at_a_time_and_can_be_skipped() -> None:
    from starlette.testclient import TestClient

    from gen_service.api.cli import build_service

    _, service = build_service("tiny:qwen2", max_batch_requests=1)
    assert service.self_check.passed
    app, service = build_service("tiny:qwen2", self_check=False)
    assert service.self_check is None
    assert TestClient(app).get("/info").json()["kvdiv"]["self_check"] == {"skipped": True}


def test_client_limits_do_not_apply_to_the_servers_own_check() -> None:
    """--max-queue 1 and a deadline shorter than the check itself: the server still starts,
    and the deadline still ends a client's request (tests/test_service_http.py)."""
    from gen_service.api.cli import build_service

    _, service = build_service("tiny:qwen2", max_queue=1, max_request_seconds=1e-3)
    assert service.self_check.passed and service.admission.count == 0


def _altered_cascade(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvdiv's decoding attention (the shared-prompt cascade) altered: outputs scaled by 1.1.
    The model's own attention, which the check compares with, is untouched."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from gen_service.attention.cascade import CASCADE

    original = ALL_ATTENTION_FUNCTIONS[CASCADE]

    def altered(*args, **kwargs):
        out, weights = original(*args, **kwargs)
        return out * 1.1, weights

    # both of transformers' tables: a first forward may have copied the entry into the local one
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, CASCADE, altered)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, CASCADE, altered)


def test_altered_attention_refuses_to_start_naming_step_and_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    from gen_service.api.cli import build_service

    _altered_cascade(monkeypatch)
    with pytest.raises(SelfCheckFailed) as err:
        build_service("tiny:llama")
    msg = str(err.value)
    assert "self-check failed on tiny:llama" in msg and "step 2" in msg     # step 1 is the prefill's own forward
    assert "full_attention × 2" in msg and "no window is involved" in msg and "--no-self-check" in msg


def test_cli_refuses_with_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from gen_service.api.cli import serve

    _altered_cascade(monkeypatch)
    result = CliRunner().invoke(serve, ["--model", "tiny:llama", "--port", "0"])
    assert result.exit_code == 1 and "self-check failed" in result.output


def test_a_tokenizer_unlike_the_checkpoints_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import gen_service.models.loading as models
    from gen_service.api.cli import build_service
    from gen_service.models.tokenizer_reference import TokenizerReference

    load = models.load_model

    def with_other_reference(*args, **kwargs):
        lm = load(*args, **kwargs)
        ids = TokenizerReference.of(lm.tokenizer, "x").ids
        lm.tokenizer_reference = TokenizerReference("the checkpoint's tokenizer.json (test)", ids[:5] + (7,) + ids[6:])
        return lm

    monkeypatch.setattr(models, "load_model", with_other_reference)
    with pytest.raises(SelfCheckFailed, match=r"not the checkpoint's.*first differing token is #5"):
        build_service("tiny:llama")


def test_layer_windows_read_every_windowed_kind() -> None:
    from transformers import Gemma3TextConfig, Qwen2Config

    gemma = Gemma3TextConfig(num_hidden_layers=6, sliding_window=16)
    assert windows_by_type(gemma) == {"sliding_attention": 16}
    assert windows_by_type(Qwen2Config(use_sliding_window=False, sliding_window=64)) == {}


def tiny_gemma3():
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              initializer_range=0.3, max_position_embeddings=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_the_reference_is_the_models_whole_sequence_forward_past_a_sliding_window() -> None:
    """The check's own reference (the prompt cached once, the paths teacher forced on it)
    equals the model's forward over each whole sequence, on a model with sliding layers."""
    from types import SimpleNamespace

    model = tiny_gemma3()
    prompt = torch.randint(5, 320, (40,)).tolist()
    paths = torch.randint(5, 320, (3, 6))
    lm = SimpleNamespace(model=model, device=torch.device("cpu"))
    got = model_logprobs(lm, prompt, paths)
    with torch.no_grad():
        whole = torch.cat([torch.tensor([prompt] * 3), paths], 1)
        law = model(input_ids=whole).logits[:, len(prompt) - 1:-1].double().log_softmax(-1)
    want = law.gather(-1, paths[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.model
def test_embedded_model_passes_with_the_ggufs_tokenizer() -> None:
    pytest.importorskip("gguf")
    from gen_service.api.cli import build_service
    from gen_service.models.loading import embedded_gguf_path

    try:
        embedded_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    _, service = build_service("embedded", device="cpu")
    check = service.self_check
    assert check.passed and check.max_error < 1e-3
    assert "GGUF's own tokenizer" in check.tokenizer["source"] and check.tokenizer["first_difference"] is None

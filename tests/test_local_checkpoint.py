"""A checkpoint of your own: a folder with weights and tokenizer loads (its tokenizer.json the self-check's
reference); a folder without a tokenizer is refused instead of served with an empty one (docs/operator.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gen_service.models.loading import TOKENIZER_FILES, byte_tokenizer, load_model, tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("my-llama")
    tiny_model("llama").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_a_folder_with_weights_and_tokenizer_loads_with_its_tokenizer_as_reference(checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = load_model(str(checkpoint), device="cpu")
    assert lm.name == str(checkpoint) and lm.vocab_size == 320   # tiny:llama's head
    assert lm.tokenizer_reference is not None
    assert lm.tokenizer_reference.source == f"the checkpoint's tokenizer.json ({checkpoint / 'tokenizer.json'})"
    text = "def f(x):\n    return 42"
    assert lm.tokenizer.encode(text, add_special_tokens=False) == byte_tokenizer().encode(text,
                                                                                           add_special_tokens=False)


def test_a_folder_without_a_tokenizer_is_refused_naming_it(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for f in checkpoint.iterdir():
        if f.name not in TOKENIZER_FILES and f.name != "chat_template.jinja":
            shutil.copy(f, weights_only / f.name)
    with pytest.raises(FileNotFoundError, match=r"weights-only: a model folder without a tokenizer \(none of "):
        load_model(str(weights_only), device="cpu")

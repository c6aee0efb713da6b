"""A faster ``gguf.GGUFReader`` for the GGUF metadata transformers reads.

transformers builds a GGUF's config and tokenizer from ``GGUFReader``'s fields, and
``AutoTokenizer`` reads the file twice (config, then tokenizer). The stock reader
parses a metadata array element by element through ``np.memmap`` views, whose
Python-level ``__getitem__``/``__array_finalize__`` dominate: Gemma 3's 262k-piece
vocabulary (tokens, scores, types: ~1.6M parts) took ~35 s per read on 2 cores.
:class:`FastGGUFReader` produces the very same fields (same parts, same indices,
same dtypes) from plain ``ndarray`` views of the map, arrays of fixed-size scalars
and of strings in one pass each; :func:`fast_gguf_reader` puts it in place of
``gguf.GGUFReader`` while transformers reads a file (``load_gguf_checkpoint``
imports the class from ``gguf`` at each call).
"""

from __future__ import annotations

import contextlib
import struct
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

_lock = threading.RLock()   # re-entrant: a block may open inside another


class FastGGUFReader(GGUFReader):
    """``GGUFReader`` with the same fields, built from plain ndarray views."""

    def __setattr__(self, name: str, value: Any) -> None:
        # the base class maps the file first thing; a plain view of the map reads the
        # same bytes without np.memmap's per-slice Python hooks
        if name == "data" and isinstance(value, np.memmap):
            value = value.view(np.ndarray)
        object.__setattr__(self, name, value)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        # only native byte order, little-endian host: otherwise the stock parser
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        offs, n = orig_offs + 12, int(alen[0])
        itype = GGUFValueType(raw_itype[0])
        nptype = self.gguf_scalar_to_np.get(itype)
        parts: list[np.ndarray] = [raw_itype, alen]
        if nptype is not None:       # one slice for the array, one 1-element view per element
            values = self._get(offs, nptype, n)
            parts += [values[i:i + 1] for i in range(n)]
            return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, itype]
        if itype != GGUFValueType.STRING or n == 0:
            return super()._get_field_parts(orig_offs, raw_type)
        data, buf = self.data, memoryview(self.data)
        u64 = struct.Struct("<Q").unpack_from
        for _ in range(n):           # (length, bytes) per string, as the stock parser
            (slen,) = u64(buf, offs)
            parts.append(data[offs:offs + 8].view(np.uint64))
            parts.append(data[offs + 8:offs + 8 + slen])
            offs += 8 + slen
        return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), [GGUFValueType.ARRAY, itype]


@contextlib.contextmanager
def fast_gguf_reader() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` is :class:`FastGGUFReader` (for the
    transformers code that reads a GGUF; one block at a time per process)."""
    import gguf

    with _lock:
        stock = gguf.GGUFReader
        gguf.GGUFReader = FastGGUFReader
        try:
            yield
        finally:
            gguf.GGUFReader = stock

"""The checkpoint's own tokenization of a fixed text, for the start-up self-check.

A server must tokenize as the checkpoint does, at its first start and every later one.
What "as the checkpoint does" means depends on where the model came from:

=========================  ====================================================
source                     the reference ids of :data:`CHECK_TEXT`
=========================  ====================================================
a GGUF file (the embedded  the tokenizer transformers builds from the file,
models too)                recorded beside the dequantised copy when it is made
                           (building it again costs ~8 s for SmolLM2 and ~60 s
                           for Gemma 3's 262k vocabulary on 2 cores, so later
                           starts read the record)
a directory, or a hub id   its ``tokenizer.json``, read by the ``tokenizers``
in the local hub cache     library itself (no transformers class in between)
``tiny:*``                 none: the byte tokenizer is built in memory
=========================  ====================================================

:func:`gen_service.serving.self_check.check_tokenizer` compares the served tokenizer's ids with
these.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHECK_TEXT", "REFERENCE_FILE", "TokenizerReference"]

REFERENCE_FILE = "tokenizer_reference.json"

# Prose, code, digits, punctuation runs, several scripts and whitespace runs: the
# places where tokenizers that differ differ (pre-tokenizer, merges, byte fallback,
# normalisation, a dummy prefix).
CHECK_TEXT = (
    'The "assert" statement is a convenient way to insert debugging assertions into a program:\n\n'
    "    assert_stmt ::= \"assert\" expression [\",\" expression]\n\n"
    "The simple form, assert expression, is equivalent to\n\n"
    "    if __debug__:\n        if not expression: raise AssertionError\n\n"
    "In 2024, 3.14159 x 10^3 = 3141.59;  tabs\tand  double  spaces,  café, naïve, Zürich, "
    "東京, Москва, 😀 — and a URL https://example.org/a_b?c=1&d=2.\n"
)


@dataclass(frozen=True)
class TokenizerReference:
    """Token ids of :data:`CHECK_TEXT` (no special tokens) by the checkpoint's own tokenizer.

    Attributes
    ----------
    source : str
        Which tokenizer produced them, in words (for ``/info`` and error messages).
    ids : tuple of int
    """

    source: str
    ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: object, source: str) -> TokenizerReference:
        """The ids a transformers tokenizer gives :data:`CHECK_TEXT`."""
        return cls(source, tuple(int(i) for i in tokenizer.encode(CHECK_TEXT, add_special_tokens=False)))

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> TokenizerReference:
        """The ids a ``tokenizer.json`` gives :data:`CHECK_TEXT`, read by the ``tokenizers`` library."""
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(path)).encode(CHECK_TEXT, add_special_tokens=False).ids
        return cls(f"the checkpoint's tokenizer.json ({path})", tuple(int(i) for i in ids))

    def save(self, directory: Path) -> None:
        """Write the record into ``directory`` (atomically: a reader sees all of it or none)."""
        tmp = directory / (REFERENCE_FILE + ".tmp")
        tmp.write_text(json.dumps({"text": CHECK_TEXT, "source": self.source, "ids": list(self.ids)}))
        os.replace(tmp, directory / REFERENCE_FILE)

    @classmethod
    def load(cls, directory: Path) -> TokenizerReference | None:
        """The record in ``directory``; None when there is none, or it was made for another text."""
        try:
            data = json.loads((directory / REFERENCE_FILE).read_text())
        except (OSError, ValueError):
            return None
        if data.get("text") != CHECK_TEXT:
            return None
        return cls(str(data["source"]), tuple(int(i) for i in data["ids"]))

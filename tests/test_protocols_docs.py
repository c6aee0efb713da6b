"""docs/contract.md: its worked examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "contract.md"


def test_contract_examples_run(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    out = capsys.readouterr().out
    assert "coupled {'doc': 1, 'policy': 1, 'replicate': 8, 'step': 6}" in out
    assert "[5 9 2 2]" in out and "[1 2 3 4]" in out
    assert "tv: 1 value(s) <= 1e-07 where x_token != y_token" in out
    assert "line 5 (doc 'q3'): 1 tokens, fewer than the horizon 4" in out
    assert "{'doc': 2, 'policy': 2, 'replicate': 2, 'step': 24}" in out      # from_openai_logprobs
    assert "snapkv@0.5  1.37  1.52  1.63" in out

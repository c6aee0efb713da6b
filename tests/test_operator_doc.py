"""docs/operator.md's flags table lists every flag of ``kvdiv serve`` (its click options)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "operator.md"


def test_the_flags_table_has_every_serve_flag() -> None:
    from gen_service.api.cli import serve

    text = DOC.read_text()
    section = text[text.index("## Flags"):]
    section = section[:section.index("\n## ", 1)]
    listed = set(re.findall(r"--[a-z][a-z-]*", section))
    flags = {o for p in serve.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
    missing = sorted(flags - listed)
    assert not missing, f"docs/operator.md's flags table lacks {missing}"

"""The collection's progress bar on stderr (tqdm): requests done, tokens/s, retries, servers busy."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from collector.servers import ServerPool

__all__ = ["Progress", "tokens_in"]


def tokens_in(record: Mapping[str, Any]) -> int:
    """Tokens a record reports (progress only): survival-path or coupled tokens, branch tokens."""
    values = record.get("token") or record.get("x_token") or []
    return sum(v is not None for v in values)


class Progress:
    """tqdm on stderr: requests done, tokens/s, retries, servers busy, ETA."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="req", desc="collect", file=sys.stderr,
                        disable=not enabled, dynamic_ncols=True, smoothing=0.1)
        self.start = time.monotonic()
        self.tokens = 0
        self.retries = 0
        self.server_note = ""

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self._postfix()

    def done(self) -> None:
        self.bar.update(1)
        self._postfix()

    def retry(self) -> None:
        self.retries += 1
        self._postfix()

    def servers(self, pool: ServerPool) -> None:
        listed = pool.listed
        busy = sum(s.in_flight > 0 for s in listed)
        self.server_note = f", {busy}/{len(listed)} servers busy"
        self._postfix()

    def _postfix(self) -> None:
        rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:.0f} tok/s, {self.retries} retries{self.server_note}", refresh=False)

    def close(self) -> None:
        self.bar.close()

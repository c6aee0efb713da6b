"""The collection's progress bar on stderr (tqdm): requests' work done, tokens/s, retries, servers busy."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from collector.servers import ServerPool

__all__ = ["Progress", "tokens_in"]


def tokens_in(record: Mapping[str, Any]) -> int:
    """Tokens a record reports (progress only): survival-path or coupled tokens, branch tokens."""
    values = record.get("token") or record.get("x_token") or []
    return sum(v is not None for v in values)


# The share of one request's work a streamed record stands for, by record type: a
# residual request's survival steps and its branches take about as long each
# (docs/service.md), and it sends one branch record per replicate at most.
_RECORD_SHARE: dict[str, Callable[[int, int], float]] = {
    "step": lambda steps, replicates: 1 / steps,
    "reference_step": lambda steps, replicates: 1 / steps,
    "shared_step": lambda steps, replicates: 0.5 / steps,
    "branch": lambda steps, replicates: 0.5 / replicates,
}
_UNFINISHED_CAP = 0.99   # a request's bar share before its end record (it may send fewer records)


class Progress:
    """tqdm on stderr: requests' work done (records streamed, in requests), tokens/s,
    retries, servers busy, ETA.

    The bar moves with every step record, not only when a request ends: with many
    requests decoded together, all of them end late and at once."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="req", desc="collect", file=sys.stderr,
                        disable=not enabled, dynamic_ncols=True, smoothing=0.1,
                        bar_format="{l_bar}{bar}| {n:.1f}/{total} req [{elapsed}<{remaining}{postfix}]")
        self.shares: dict[str, float] = {}   # request key -> its share counted so far, in requests
        self.start = time.monotonic()
        self.tokens = 0
        self.retries = 0
        self.server_note = ""

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self._postfix()

    def record(self, key: str, record_type: str, steps: int, replicates: int) -> None:
        """A record of request ``key`` arrived: move the bar by the share of work it stands for."""
        share = _RECORD_SHARE.get(record_type)
        if share is None:
            return
        before = self.shares.get(key, 0.0)
        after = min(before + share(steps, replicates), _UNFINISHED_CAP)
        self.shares[key] = after
        self.bar.update(after - before)

    def done(self, key: str) -> None:
        self.bar.update(1 - self.shares.pop(key, 0.0))
        self._postfix()

    def undo(self, key: str) -> None:
        """A request's attempt failed: what it streamed is not work done."""
        self.bar.update(-self.shares.pop(key, 0.0))

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

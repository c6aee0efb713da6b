"""What a collection did: :class:`CollectResult` (counts, failures, throughput) and its summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from collector.servers import ServerStats

__all__ = ["CollectResult"]


@dataclass
class CollectResult:
    """What a collection did: counts, failures (request -> last error), throughput.

    Attributes
    ----------
    total, skipped, completed : int
        Requests in the run, already complete before, collected now.
    failed : dict
        ``"doc × policy"`` -> the reason it failed.
    set_aside : dict
        ``"doc × policy"`` -> why its journal file was set aside for recollection.
    refused : dict
        policy -> (the server's reason, the documents it was refused for): policies a
        server refuses on its model by design (a 422 marked permanent), never retried;
        a rerun cannot collect them.
    retries, tokens : int
        Attempts repeated, tokens received.
    elapsed_s : float
        Wall time.
    servers : dict
        url -> :class:`collector.servers.ServerStats` (requests, failures, tokens/s),
        for every server that was listed during the run.
    """

    total: int
    skipped: int
    completed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    set_aside: dict[str, str] = field(default_factory=dict)
    refused: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    retries: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    servers: dict[str, ServerStats] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.refused

    @property
    def retry_helps(self) -> bool:
        """Whether rerunning may collect more: some request failed other than by a designed refusal."""
        return bool(self.failed)

    def refused_text(self) -> str:
        """Each refused policy once: its reason and the (document, policy) pairs it affects."""
        lines = []
        for policy, (reason, docs) in sorted(self.refused.items()):
            shown = ", ".join(docs[:10]) + (f" and {len(docs) - 10} more" if len(docs) > 10 else "")
            lines.append(f"  REFUSED {policy} for {len(docs)} document(s) ({shown}), permanent, not retried: {reason}")
        return "\n".join(lines)

    def server_table(self) -> str:
        """Per-server throughput: requests completed, failed attempts, tokens, tokens/s while busy."""
        if not self.servers:
            return ""
        width = max(len("server"), *(len(url) for url in self.servers))
        lines = [f"  {'server':<{width}}  requests  failures    tokens  tokens/s"]
        lines += [f"  {s.url:<{width}}  {s.requests:>8}  {s.failures:>8}  {s.tokens:>8}  {s.tokens_per_s:>8.1f}"
                  for s in self.servers.values()]
        return "\n".join(lines)

    def summary(self) -> str:
        rate = self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        text = (f"{self.completed} requests collected, {self.skipped} already complete, "
                f"{len(self.failed)} failed, {self.retries} retries; {self.tokens} tokens in "
                f"{self.elapsed_s:.1f} s ({rate:.1f} tokens/s)")
        if self.servers:
            text += "\n" + self.server_table()
        for key, reason in sorted(self.set_aside.items()):
            text += f"\n  SET ASIDE {key}: {reason}"
        if self.refused:
            n = sum(len(docs) for _, docs in self.refused.values())
            text += f"; {n} (document, policy) pairs refused by design\n" + self.refused_text()
        for key, reason in sorted(self.failed.items()):
            text += f"\n  FAILED {key}: {reason}"
        return text

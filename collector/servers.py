"""The servers a collection runs on: who is listed, who is answering, who has room, who did what.

A :class:`ServerPool` holds the ``--server`` URLs (always listed) and those of a
``--servers-file`` (re-read every ``poll_s`` seconds, so servers can join and leave
during a run). The collector asks it for a server with a free slot
(:meth:`ServerPool.pick`) before each request and tells it how the request went:

- a server gets at most ``concurrency`` requests at a time, and the least loaded
  listed server is picked first, so every server is kept busy;
- a server that disappears from the file gets no new request (its requests in
  flight finish, or are retried elsewhere);
- a server that stops answering (connection refused, connect or read timeout) is
  taken out of rotation for a backoff that doubles with each failure in a row
  (``backoff_s`` up to ``backoff_max_s``); then it gets one probe request at a time
  until one succeeds;
- per server it counts completed requests, failed attempts and tokens, and the time
  it had a request in flight (:class:`ServerStats`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Server", "ServerPool", "ServerStats", "read_servers_file"]


def read_servers_file(path: str | Path) -> tuple[list[str], list[str]]:
    """The server URLs a servers file lists, and the problems of the lines it skipped.

    One URL per line; blank lines and ``#`` comments are ignored; trailing ``/`` is
    dropped; a URL listed twice counts once.

    Parameters
    ----------
    path : path
        The servers file.

    Returns
    -------
    (list of str, list of str)
        The URLs in file order, and one ``"file:line: problem"`` per skipped line.

    Raises
    ------
    OSError
        The file cannot be read.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "servers.txt"
    >>> _ = f.write_text("# GPUs\\nhttp://gpu1:8080/\\n\\ngpu2:8080\\nhttp://gpu1:8080\\n")
    >>> read_servers_file(f)[0]
    ['http://gpu1:8080']
    >>> read_servers_file(f)[1][0].endswith(":4: 'gpu2:8080' is not an http:// or https:// URL")
    True
    """
    urls: list[str] = []
    problems: list[str] = []
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not line.startswith(("http://", "https://")) or len(line.split()) != 1:
            problems.append(f"{path}:{number}: {line!r} is not an http:// or https:// URL")
            continue
        url = line.rstrip("/")
        if url not in urls:
            urls.append(url)
    return urls, problems


@dataclass(frozen=True)
class ServerStats:
    """What one server did in a run.

    Attributes
    ----------
    url : str
        The server.
    requests : int
        Requests it completed.
    failures : int
        Attempts on it that failed (retried elsewhere or reported).
    tokens : int
        Tokens of the requests it completed.
    busy_s : float
        Seconds it had at least one request in flight.
    """

    url: str
    requests: int
    failures: int
    tokens: int
    busy_s: float

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second while busy (0 when it never was)."""
        return self.tokens / self.busy_s if self.busy_s > 0 else 0.0


class Server:
    """One server's state in a :class:`ServerPool` (mutable; read it through the pool)."""

    def __init__(self, url: str, static: bool) -> None:
        self.url, self.static = url, static
        self.listed = True
        self.in_flight = 0
        self.failures_in_row = 0   # "stops answering" failures since its last success
        self.down_until = 0.0      # out of rotation until then (monotonic clock)
        self.requests = self.failures = self.tokens = 0
        self.busy_s = 0.0
        self._busy_since: float | None = None

    @property
    def healthy(self) -> bool:
        """Listed, and its last request did not find it unreachable."""
        return self.listed and self.failures_in_row == 0

    def stats(self, now: float) -> ServerStats:
        busy = self.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        return ServerStats(self.url, self.requests, self.failures, self.tokens, busy)


class ServerPool:
    """The run's servers: listing (``--server`` plus a re-read servers file), health, load and stats.

    Parameters
    ----------
    static : sequence of str
        ``--server`` URLs: always listed.
    servers_file : path, optional
        A file of URLs (:func:`read_servers_file`), re-read every ``poll_s`` seconds.
    concurrency : int
        Requests in flight per server.
    backoff_s, backoff_max_s : float
        First and longest time out of rotation for a server that stops answering.
    poll_s : float
        Seconds between reads of ``servers_file``.
    say : callable
        Where notices go (servers joining, leaving, going down, a bad file line).
    clock : callable
        Monotonic seconds (tests pass their own).

    Examples
    --------
    >>> pool = ServerPool(["http://a:1", "http://b:1"], concurrency=2, say=lambda m: None)
    >>> first = pool.pick(); pool.started(first); second = pool.pick()
    >>> first.url != second.url  # the least loaded server first
    True
    """

    def __init__(self, static: Sequence[str], servers_file: str | Path | None = None, *, concurrency: int = 1,
                 backoff_s: float = 1.0, backoff_max_s: float = 60.0, poll_s: float = 2.0,
                 say: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic) -> None:
        self.servers_file = Path(servers_file) if servers_file is not None else None
        self.concurrency, self.backoff_s, self.backoff_max_s = concurrency, backoff_s, backoff_max_s
        self.poll_s, self.say, self.clock = poll_s, say, clock
        self.servers: dict[str, Server] = {url: Server(url, static=True) for url in dict.fromkeys(static)}
        self._file_problems: set[str] = set()
        self._next_poll = 0.0
        self.refresh()

    # ------------------------------------------------------------------ listing
    def refresh(self, force: bool = True) -> None:
        """Re-read the servers file (at most every ``poll_s`` unless ``force``); list and unlist servers."""
        now = self.clock()
        if self.servers_file is None or (not force and now < self._next_poll):
            return
        self._next_poll = now + self.poll_s
        try:
            urls, problems = read_servers_file(self.servers_file)
        except OSError as exc:  # being rewritten, or gone: keep the last listing
            problems, urls = [f"{self.servers_file}: cannot read ({exc.strerror or exc}); keeping the last list"], None
        for problem in set(problems) - self._file_problems:
            self.say(problem)
        self._file_problems = set(problems)
        if urls is not None:
            self._relist(urls)

    def _relist(self, urls: Iterable[str]) -> None:
        wanted = set(urls)
        for url in urls:
            server = self.servers.get(url)
            if server is None:
                self.servers[url] = Server(url, static=False)
                self.say(f"server {url} joined")
            elif not server.listed:
                server.listed = True
                self.say(f"server {url} is listed again")
        for server in self.servers.values():
            if server.listed and not server.static and server.url not in wanted:
                server.listed = False
                busy = f"; its {server.in_flight} requests in flight finish there" if server.in_flight else ""
                self.say(f"server {server.url} left the servers file: no new requests{busy}")

    # ------------------------------------------------------------------ dispatch
    def capacity(self, server: Server) -> int:
        """Requests ``server`` may have in flight now: 0 unlisted or down, 1 while probed, else ``concurrency``."""
        if not server.listed or self.clock() < server.down_until:
            return 0
        return 1 if server.failures_in_row else self.concurrency

    def pick(self) -> Server | None:
        """The listed, answering server with a free slot and the fewest requests in flight (None: all full)."""
        free = [s for s in self.servers.values() if s.in_flight < self.capacity(s)]
        return min(free, key=lambda s: (s.in_flight, s.failures_in_row), default=None)

    def started(self, server: Server) -> None:
        """A request was sent to ``server``."""
        if server.in_flight == 0:
            server._busy_since = self.clock()
        server.in_flight += 1

    def finished(self, server: Server, *, tokens: int | None = None, unreachable: bool = False,
                 counted: bool = True) -> None:
        """A request on ``server`` ended: completed (``tokens`` given), failed (found it unreachable, or
        not), or was cancelled (``counted=False``: the run is ending)."""
        server.in_flight -= 1
        if server.in_flight == 0 and server._busy_since is not None:
            server.busy_s += self.clock() - server._busy_since
            server._busy_since = None
        if not counted:
            return
        if tokens is not None:
            server.requests += 1
            server.tokens += tokens
            if server.failures_in_row:
                self.say(f"server {server.url} answers again")
            server.failures_in_row = 0
            return
        server.failures += 1
        if unreachable:
            server.failures_in_row += 1
            wait = min(self.backoff_max_s, self.backoff_s * 2 ** (server.failures_in_row - 1))
            server.down_until = self.clock() + wait
            if server.failures_in_row == 1:
                self.say(f"server {server.url} is not answering: out of rotation, retried in {wait:g} s "
                         "(then with a doubling backoff)")

    # ------------------------------------------------------------------ state
    @property
    def listed(self) -> list[Server]:
        return [s for s in self.servers.values() if s.listed]

    @property
    def healthy(self) -> bool:
        """Some listed server answered its last request (or has not been tried yet)."""
        return any(s.healthy for s in self.servers.values())

    def next_change(self) -> float | None:
        """Seconds until a down server may be probed again (None: none is waiting)."""
        now = self.clock()
        waits = [s.down_until - now for s in self.listed if s.down_until > now]
        return min(waits, default=None)

    def describe(self) -> str:
        """Why no server can take work, in words (for the waiting message)."""
        where = f" in {self.servers_file}" if self.servers_file is not None else ""
        listed = self.listed
        if not listed:
            return f"no server is listed{where}"
        return f"none of the {len(listed)} listed servers{where} is answering"

    def stats(self) -> dict[str, ServerStats]:
        """Per-server counts, every server that was ever listed, in the order they joined."""
        now = self.clock()
        return {url: server.stats(now) for url, server in self.servers.items()}

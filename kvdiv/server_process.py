"""``kvdiv serve`` as a child process: start it, wait for its ready line, stop it, and let it
die with its parent.

``kvdiv demo`` starts one server per model with it, and so do the tests and benchmarks
that need a real server process (``tests/test_demo.py``, ``tests/test_service_http.py``,
``benchmarks/gpu_check.py``); tests that only need the app serve it in a thread instead
(``tests/service_live.py``), which is no child process and not this module's job.

It lives in the application layer, not in ``collector`` or ``gen_service``: it runs the
``kvdiv`` command itself (``python -m kvdiv serve``), which only the application layer
knows; it imports nothing of the server (the child does), so it loads no torch.

The life of a child:

1. :class:`ServerProcess` starts ``python -m kvdiv serve ARGS`` with its stderr in a log
   file; a thread copies its stdout into the same log and watches for the ready line
   (:data:`SERVER_READY`, printed once the server accepts connections, with the bound
   URL: ``--port 0`` picks any free port);
2. :meth:`ServerProcess.wait_ready` waits for that line and for ``GET /health``, or
   stops the child and raises :class:`ServerError` with the end of its log;
3. :meth:`ServerProcess.stop` terminates it (SIGTERM, then SIGKILL after a grace time);
   it is a context manager, so ``with ServerProcess(...)`` stops it on every exit;
4. on Linux the child asks the kernel to SIGTERM it when the parent dies, even by
   SIGKILL (:func:`die_with_parent`), and :func:`terminate_as_interrupt` turns the
   parent's own SIGTERM into ``KeyboardInterrupt``, so ``kill <parent>`` runs the same
   clean-up as Ctrl-C.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

__all__ = ["SERVER_READY", "ServerError", "ServerProcess", "die_with_parent", "terminate_as_interrupt",
           "wait_health"]

#: The line ``kvdiv serve`` prints on stdout once it accepts connections, followed by its URL.
SERVER_READY = "kvdiv serve ready: "
#: How a server is started: this interpreter running the ``kvdiv`` command.
KVDIV_SERVE = (sys.executable, "-m", "kvdiv", "serve")


class ServerError(RuntimeError):
    """A server that exited before it was ready, or did not become ready in time."""


def die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when its parent dies, even by SIGKILL.

    Without this, a parent killed hard would leave a model server running on the port.
    Elsewhere (or without libc) it does nothing.
    """
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C inside the block, so ``kill <parent>`` also stops its servers.

    Outside the main thread (where signals cannot be set) it leaves signals alone.
    """
    import signal

    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, raise_interrupt)
    except ValueError:  # not the main thread (e.g. called from a worker): leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class ServerProcess:
    """``kvdiv serve ARGS`` as a child process; its output goes to a log file.

    Parameters
    ----------
    args : sequence of str
        ``kvdiv serve``'s arguments (``--model``, ``--port 0``, ...).
    log_path : path
        The log: the child's stderr and stdout, appended (``append=False``: replaced).
    env : mapping, optional
        Variables set in the child on top of this process's environment (e.g. ``KVDIV_API_KEY``).
    command : sequence of str
        What runs ``kvdiv serve`` (:data:`KVDIV_SERVE`; a wrapper such as a fork server may prefix it).
    append : bool
        Append to the log (a resumed run keeps the earlier servers' lines) or replace it.

    Attributes
    ----------
    url : str or None
        The server's URL once its ready line was seen.
    proc : subprocess.Popen
        The child.

    Examples
    --------
    >>> with ServerProcess(["--model", "tiny:llama", "--port", "0"], Path("serve.log")) as server:  # doctest: +SKIP
    ...     url = server.wait_ready(120)
    """

    def __init__(self, args: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
                 command: Sequence[str] = KVDIV_SERVE, append: bool = True) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        if not append:
            log_path.write_text("", encoding="utf-8")
        # append mode, so that the child's stderr and this process's copy of its stdout never overwrite each other
        self._log: TextIO = open(log_path, "a", encoding="utf-8")
        self.proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, **(env or {})},
                                     preexec_fn=die_with_parent if sys.platform == "linux" else None)
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        # The server prints its bound URL once it accepts connections (port 0 = any free port).
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith(SERVER_READY) and self.url is None:
                self.url = line[len(SERVER_READY):].split()[0]
                self._ready.set()
        self._ready.set()  # EOF: the process ended

    def wait_ready(self, timeout_s: float, health_timeout_s: float = 60.0) -> str:
        """The server's URL once it printed its ready line and answers ``GET /health``.

        Raises
        ------
        ServerError
            It exited first, or did not become ready within ``timeout_s``; the child is
            stopped and the message ends with the last lines of its log.
        """
        if not self._ready.wait(timeout_s) or self.url is None:
            code = self.proc.poll()
            if code is None and self._ready.is_set():   # its stdout closed: it is exiting, not yet reaped
                try:
                    code = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            self.stop()
            why = (f"exited with code {code} before it was ready" if code is not None
                   else f"did not start within {timeout_s:.0f} s")
            raise ServerError(f"the server {why}; the end of {self.log_path}:\n{self.log_tail()}")
        wait_health(self.url, health_timeout_s)
        return self.url

    def exit_reason(self) -> str | None:
        """Why the server is gone (its exit code and log), or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"the server exited (code {code}); see {self.log_path}"

    def log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of the log."""
        try:
            return "\n".join(self.log_path.read_text(encoding="utf-8").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """Terminate the child (SIGKILL after ``grace_s``) and close the log; a stopped server stays stopped."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def wait_health(url: str, timeout_s: float = 60.0) -> None:
    """Wait until ``GET url/health`` answers 200.

    Raises
    ------
    ServerError
        No 200 within ``timeout_s``.
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.5)

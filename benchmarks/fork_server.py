"""Run Python commands in processes forked from one interpreter that imported the stack once.

    python benchmarks/fork_server.py serve SOCKET MODULE...   # import MODULEs, then fork per request
    python benchmarks/fork_server.py run SOCKET ARGS...       # `python ARGS...` in a forked child

The GPU check's dry run (``gpu_check.sh --dry-run``) starts eight interpreters, and each
one imports torch, transformers and kvpress before doing a few seconds of work with tiny
models: on a 2-core CPU the imports were ~70 of its ~90 seconds. On the dry run the
script starts this server once and runs every step through ``run``, whose command line,
time limit and log are the step's own: ``run`` passes its standard streams, working
directory, environment and arguments to the server; the server forks a child that takes
them over and runs ``python ARGS`` there (``-m MODULE``, ``-c CODE``, ``-`` for a script on
standard input, or a script path); ``run`` exits with the child's status. A SIGTERM or SIGINT to
``run`` (``timeout``, ``Popen.terminate``) reaches the child, and a ``run`` that dies
takes its child with it. The real check on a GPU does not use it: there each step is
its own interpreter, as a user runs it.

Forking after ``import torch`` is safe while no thread pool has started: the server only
imports (torch starts its OpenMP and CUDA state on first use, in the child).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

_STATUS_BYTES = 16


def _exit_status(status: int) -> int:
    """A waitpid status as a shell reports it (128 + N for a signal)."""
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _run_here(argv: list[str]) -> int:
    """``python ARGV`` in this (forked) process; its exit status."""
    import runpy
    import traceback

    code = 0
    try:
        if argv[:1] == ["-m"]:
            sys.argv = argv[1:]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[:1] in (["-"], ["-c"]):
            source = sys.stdin.read() if argv[0] == "-" else argv[1]
            sys.argv = ["-c", *argv[2:]] if argv[0] == "-c" else argv
            sys.path.insert(0, os.getcwd())
            exec(compile(source, "<stdin>" if argv[0] == "-" else "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:   # as the interpreter reports it: an int as is, None 0, a message 1
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (a command's crash is its status, as in its own interpreter)
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    return code


def _handle(conn: socket.socket) -> None:
    """One request, in a child of the server: fork the command, relay signals, report its status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # the server ignores it; this process waits
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        os._exit(_run_here(request["argv"]))
    for fd in fds:
        os.close(fd)
    child = os.pidfd_open(pid)
    watched = [conn, child]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if child in ready:
            status = _exit_status(os.waitpid(pid, 0)[1])
            if conn in watched:
                conn.sendall(str(status).encode().ljust(_STATUS_BYTES))
            return
        data = conn.recv(64)
        if not data:               # the caller is gone: so is its command
            os.kill(pid, signal.SIGKILL)
            watched = [child]
        else:
            for sig in data.decode().split():
                os.kill(pid, int(sig))


def serve(path: str, modules: list[str]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # request handlers are reaped by the kernel
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path + ".tmp")
    os.rename(path + ".tmp", path)                 # the path appears once it accepts
    sock.listen(16)
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        conn, _ = sock.accept()
        if os.fork() == 0:
            sock.close()
            try:
                _handle(conn)
            finally:
                os._exit(0)
        conn.close()


def run(path: str, argv: list[str]) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])

    def relay(sig: int, _frame: object) -> None:
        sock.sendall(f"{sig} ".encode())

    signal.signal(signal.SIGTERM, relay)
    signal.signal(signal.SIGINT, relay)
    reply = b""
    while len(reply) < _STATUS_BYTES:
        part = sock.recv(_STATUS_BYTES - len(reply))
        if not part:
            return 1   # the server died under it
        reply += part
    return int(reply.decode())


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("serve", "run"):
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET MODULE... | run SOCKET ARGS...")
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(run(sys.argv[2], sys.argv[3:]))

"""kvdiv.server_process: a child's ready line, its failures, its stop, and its death with its parent.

The child here is a stand-in for ``kvdiv serve`` (a few lines of Python given as ``command``):
the module's subject is the process's life, which a model would only slow down. The real
command is started by tests/test_demo.py (the demo's own server) and tests/test_service_http.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvdiv.server_process import SERVER_READY, ServerError, ServerProcess

#: Serves GET /health with 200 on a free port, then prints the ready line (as ``kvdiv serve`` does).
HEALTHY = f"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", 0), H)
print("loading", file=sys.stderr, flush=True)
print("{SERVER_READY}http://127.0.0.1:%d" % srv.server_address[1], flush=True)
srv.serve_forever()
"""


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_ready_line_gives_the_url_and_stop_ends_the_child(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with ServerProcess([], log, command=_child(HEALTHY)) as server:
        url = server.wait_ready(30)
        assert url.startswith("http://127.0.0.1:") and httpx.get(url + "/health").status_code == 200
        assert server.exit_reason() is None
    assert server.proc.poll() is not None                        # stopped on leaving the block
    assert "loading" in log.read_text() and SERVER_READY + url in log.read_text()   # stderr and stdout both


def test_a_child_that_exits_first_is_reported_with_its_log(tmp_path: Path) -> None:
    code = "import sys; print('no such model', file=sys.stderr); sys.exit(3)"
    server = ServerProcess([], tmp_path / "serve.log", command=_child(code))
    with pytest.raises(ServerError, match=r"exited with code 3 before it was ready(.|\n)*no such model"):
        server.wait_ready(30)
    assert server.exit_reason() == f"the server exited (code 3); see {tmp_path / 'serve.log'}"


def test_a_child_that_never_gets_ready_is_stopped(tmp_path: Path) -> None:
    server = ServerProcess([], tmp_path / "serve.log", command=_child("import time; time.sleep(60)"))
    with pytest.raises(ServerError, match="did not start within 1 s"):
        server.wait_ready(1)
    assert server.proc.poll() is not None


def test_the_log_is_appended_to_unless_asked_otherwise(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_text("an earlier run\n")
    for append in (True, False):
        ServerProcess([], log, command=_child("print('this run')"), append=append).proc.wait(30)
    time.sleep(0.2)   # the copying thread writes the child's last line after it exits
    assert log.read_text().splitlines() == ["this run"]


#: A parent that starts a never-ready child, prints its pid, and waits to be killed.
PARENT = """
import sys, time
from pathlib import Path
from kvdiv.server_process import ServerProcess
server = ServerProcess([], Path(sys.argv[1]), command=[sys.executable, "-c", "import time; time.sleep(120)"])
print(server.proc.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_dies_with_its_parent_even_by_sigkill(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "serve.log")], stdout=subprocess.PIPE,
                              text=True, env=env)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(30)
    for _ in range(300):   # the kernel signals the child at once; allow a loaded machine 30 s
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        if _zombie(child):
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the child outlived its SIGKILLed parent")


def _zombie(pid: int) -> bool:
    """Dead but not yet reaped by init (its parent is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True

"""A live loopback uvicorn over the tiny model, shared by the service test modules."""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import socket
import threading
import time

from gen_service.api.cli import build_service

PROMPT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 2


class LiveServer:
    """``build_service(model, **kw)`` (default ``tiny:llama``) served on a free loopback port in a thread."""

    def __init__(self, model: str = "tiny:llama", **kw) -> None:
        import uvicorn

        self.app, self.service = build_service(model, **kw)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)

"""What several benchmarks share: their prompt text, a clock that waits for the device,
functions timed in turn, and a server in a thread.

The benchmarks are scripts (``python benchmarks/bench_*.py``), so this sits beside them
and they import it by name (a script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PARAGRAPH", "chat_prompt_ids", "clock", "interleaved", "prose_ids", "serve_in_thread"]

#: A paragraph of CPython's language reference, repeated to any prompt length.
PARAGRAPH = (
    "A block is a piece of Python program text that is executed as a unit. The following are blocks: a "
    "module, a function body, and a class definition. Each command typed interactively is a block. A script "
    "file is a code block. When a name is used in a code block, it is resolved using the nearest enclosing "
    "scope. The set of all such scopes visible to a code block is called the block's environment. "
)


def prose_ids(tokenizer, n: int) -> list[int]:
    """The first ``n`` token ids of :data:`PARAGRAPH` repeated (raw text, no template)."""
    text = PARAGRAPH
    while len(tokenizer(text).input_ids) < n:
        text += PARAGRAPH
    return list(tokenizer(text).input_ids[:n])


def chat_prompt_ids(tokenizer, n: int) -> list[int]:
    """A chat prompt asking to summarise ``n`` tokens of :data:`PARAGRAPH`, through the model's template."""
    body = tokenizer.decode(prose_ids(tokenizer, n))
    msgs = [{"role": "user", "content": "Summarise this text.\n\n" + body}]
    out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def clock(device: torch.device) -> float:
    """Wall time once the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def interleaved(fns: dict[str, Callable[[], Any]], calls: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each function, the functions called in turn ``calls`` times after
    one warm-up call each (so that the machine's load hits them alike)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(calls):
        for name, fn in fns.items():
            t0 = clock(device)
            fn()
            times[name].append(clock(device) - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def serve_in_thread(model: str, **options: Any) -> tuple[str, Any, Any]:
    """(url, uvicorn server, service): ``kvdiv serve``'s app for ``model`` on a free loopback
    port, in a daemon thread; ``options`` go to ``gen_service.api.cli.build_service``."""
    import socket
    import threading

    import uvicorn

    from gen_service.api.cli import build_service

    app, service = build_service(model, max_new_tokens=64, **options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, service

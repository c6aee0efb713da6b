"""P + Q fusion timing: whether P's and Q's stacked forwards of a step run as one forward.

One forward over both stacks halves the kernel launches but attends group by group
anyway; which is faster depends on rows, forwards and prompt length. ``"auto"``
measures it once per shape bucket on the live caches and keeps the answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from gen_service.engine.sides import Forward

__all__ = ["Grouped", "bucket", "fused", "measure"]

log = logging.getLogger("kvdiv.service")

Grouped = list[list[tuple[int, int, Forward]]]   # per group: (candidate, 0 = P / 1 = Q, forward)
Runs = Callable[[list[Forward]], Any]


def bucket(n: int) -> int:
    """The next power of two (shapes measured once per bucket)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def fused(groups: Grouped, mode: str, measured: dict[tuple[int, int, int], dict[str, Any]],
          apart: Runs, together: Runs, device: torch.device) -> bool:
    """``mode`` "on"/"off", or "auto": measured on the first step of each shape
    (:func:`measure`, kept in ``measured``). ``apart`` runs one group, ``together``
    one stacked forward."""
    if mode != "auto":
        return mode == "on"
    forwards = [f for group in groups for _, _, f in group]
    rows = sum(f.tokens.shape[0] for f in forwards)
    prompt = max(f.side.cache.layers[0].prompt_keys.shape[-2] for f in forwards)
    key = (bucket(rows), len(forwards), bucket(prompt))
    if key not in measured:
        measured[key] = measure(groups, key, apart, together, device)
    return measured[key]["fused"]


def measure(groups: Grouped, key: tuple[int, int, int], apart: Runs, together: Runs,
            device: torch.device) -> dict[str, Any]:
    """Time this decoding step both ways — P's and Q's forwards apart, and one forward
    over both — three times alternately, on the live caches: a forward only writes
    the rows' new slot and advances ``filled``, so putting ``filled`` back undoes it
    (the real step then writes the same slot). Keeps the faster (best of three)."""
    parts = [[f for _, _, f in group] for group in groups]
    layers = [layer for part in parts for f in part for layer in f.side.cache.layers]
    filled = [layer.filled for layer in layers]
    times: dict[str, list[float]] = {"separate": [], "fused": []}
    for _ in range(3):
        for mode in times:
            t0 = _clock(device)
            if mode == "separate":
                for part in parts:
                    apart(part)
            else:
                together(parts[0] + parts[1])
            times[mode].append(_clock(device) - t0)
            for layer, n in zip(layers, filled, strict=True):
                layer.filled = n
    sep, fast = min(times["separate"]), min(times["fused"])
    log.info("fused P+Q forward for rows<=%d, %d forwards, prompt<=%d: %.1f ms vs %.1f ms apart", *key,
             fast * 1e3, sep * 1e3)
    return {"rows": key[0], "forwards": key[1], "prompt_tokens": key[2], "separate_ms": round(sep * 1e3, 2),
            "fused_ms": round(fast * 1e3, 2), "fused": fast < sep}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

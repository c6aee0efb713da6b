"""CUDA graphs of the stacked decoding forward (``kvdiv serve --cuda-graphs``).

A decoding forward of a small model on a GPU is mostly kernel launches from Python.
With static shapes (:class:`~gen_service.attention.shared_cache.StackedPromptCache` with
``static=True``: the rows' writes at slots held in a tensor, attention over the
pooled buffers' whole capacity with the unfilled slots masked) every tensor the
forward reads keeps its address and shape from one step to the next while the same
groups decode, so the forward is captured once in a CUDA graph and replayed at each
later step: the inputs (tokens, positions, write slots, visibility) are copied into
the graph's own buffers, the graph replays, and the groups' fill counts (host
bookkeeping the replay does not run) advance by one.

A graph is kept per pool (the groups' buffers it reads) and rows; a graph whose pool
the groups left (a residual branch ended, a request finished) is dropped. Only the
stacked forwards of the shared-prompt path are graphed; every other forward runs as
before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from gen_service.attention.shared_cache import StackedPromptCache, attention_route
from gen_service.engine.forwards import run_stacked
from gen_service.engine.sides import Forward
from gen_service.models.float_head import logits as fp32_logits

__all__ = ["CudaGraphs"]

log = logging.getLogger("kvdiv.service")


@dataclass
class _Graph:
    graph: Any                         # torch.cuda.CUDAGraph
    pools: list[Any]                   # the pools the graph reads (kept alive while it may replay)
    tokens: torch.Tensor               # (rows, 1) input buffer
    positions: torch.Tensor            # (rows, 1)
    write_at: torch.Tensor             # (rows,)
    visible: torch.Tensor | None       # (rows, 1, 1, capacity)
    out: torch.Tensor                  # (rows, V) logits the replay writes


class CudaGraphs:
    """Captured stacked forwards of one model, replayed while their groups decode.

    Parameters
    ----------
    model : torch.nn.Module
        The model, on a CUDA device.

    Raises
    ------
    ValueError
        If the model is not on a CUDA device (graphs are CUDA's).
    """

    def __init__(self, model: torch.nn.Module):
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {device.type}")
        self.model = model
        self.graphs: dict[tuple[int, ...], _Graph] = {}
        self.captured = 0
        self.failed: str | None = None    # why a capture failed (then every forward runs eagerly)

    @torch.inference_mode()
    def run(self, forwards: list[Forward]) -> list[torch.Tensor]:
        """The stacked forward over ``forwards``' rows, from a graph (captured on first use).
        Should a capture fail (an operation in the model's forward that a graph cannot
        hold), the reason is logged and kept (:meth:`info`), and this and every later
        stacked forward runs eagerly, as without the flag."""
        if self.failed is not None:
            return run_stacked(self.model, forwards)
        return self._run(forwards)

    def _run(self, forwards: list[Forward]) -> list[torch.Tensor]:
        stack = StackedPromptCache([f.side.cache for f in forwards], [f.mask for f in forwards], static=True)
        pools = [layer.pool for layer in stack.layers]
        key = tuple(id(p) for p in pools) + (stack.rows,)
        # drop graphs whose pools no stack holds any more (the groups moved on)
        for k in [k for k, g in self.graphs.items() if k != key and not _alive(g)]:
            del self.graphs[k]
        entry = self.graphs.get(key)
        tokens = torch.cat([f.tokens for f in forwards])[:, None]
        positions = torch.cat([f.positions for f in forwards])[:, None]
        if entry is None:
            try:
                entry = self._capture(stack, pools, tokens, positions)
            except RuntimeError as exc:   # the fill counts are back: run this step eagerly
                self.failed = f"{type(exc).__name__}: {exc}"[:300]
                log.warning("CUDA graph capture failed; stacked forwards run eagerly: %s", self.failed)
                return run_stacked(self.model, forwards)
            self.graphs[key] = entry
        entry.tokens.copy_(tokens)
        entry.positions.copy_(positions)
        entry.write_at.copy_(stack.write_at)
        if entry.visible is not None:
            entry.visible.copy_(stack.visible)
        entry.graph.replay()
        for layer in stack.layers:       # what update() does on the host, which a replay skips
            for part in layer.parts:
                part.filled += 1
        return list(entry.out.clone().split([f.tokens.shape[0] for f in forwards]))

    def _capture(self, stack: StackedPromptCache, pools: list[Any], tokens: torch.Tensor,
                 positions: torch.Tensor) -> _Graph:
        """Warm up on a side stream, then capture one forward; each pass writes the rows'
        next slot and advances the fill counts, which are put back (the replay of this
        step writes the same slot)."""
        parts = [part for layer in stack.layers for part in layer.parts]
        filled = [part.filled for part in parts]
        tok, pos = tokens.clone(), positions.clone()
        # the forward reads these through the stack: make them the graph's own buffers
        stack.write_at = stack.write_at.clone()
        stack.visible = None if stack.visible is None else stack.visible.clone()

        def forward() -> torch.Tensor:
            with attention_route(self.model, stack, None) as (_, kw):
                out = fp32_logits(self.model, 0, input_ids=tok, past_key_values=stack, position_ids=pos,
                                  use_cache=True, **kw)
            return out[:, -1]

        def rewind() -> None:
            for part, n in zip(parts, filled, strict=True):
                part.filled = n

        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward()
                    rewind()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = forward()
        finally:
            rewind()
        self.captured += 1
        log.info("captured a CUDA graph of the stacked forward: %d rows, %d groups", stack.rows, len(stack.groups))
        return _Graph(graph, pools, tok, pos, stack.write_at, stack.visible, out)

    def info(self) -> dict[str, Any]:
        """Graphs held and captured so far, and why a capture failed (``/info``)."""
        return {"held": len(self.graphs), "captured": self.captured, "failed": self.failed}


def _alive(entry: _Graph) -> bool:
    """Whether every pool a graph reads still holds its groups."""
    return all(pool.holds(pool.parts) for pool in entry.pools)

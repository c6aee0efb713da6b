"""Linear layers whose rows do not depend on their batch-mates on the CPU.

A decoding step multiplies every row of the batch by each weight at once, so a row's
numbers are computed beside whatever else is decoded with it. On the CPU, oneMKL's
sgemm sums a row of x · Wᵀ one way when the product has fewer than 12 rows (its
remainder kernels) and one other way from 12 rows on. From 12 on, a row's bits no
longer depend on how many rows there are or where it sits. This was measured on this
project's 2-core AVX2 machine for 2048 × 640, 640 × 2048, 1024 × 640, 1536 × 576 and
576 × 1536 weights, 2 to 256 rows, at every position. One row alone takes yet another
path (a matrix-vector product).

Without padding, a request with one candidate and R = 2 decoded its P and Q forwards
over 2 rows each when alone and over 16 when merged with 7 others. Its TV differed by
up to 5e-7 (tests/test_batch_invariance.py). :func:`pad_linear_rows` gives every plain
``nn.Linear`` of the decoder at least :data:`MIN_ROWS` rows per product on the CPU,
adding zero rows below that, as the float32 head does with its columns
(``gen_service.models.float_head.MIN_COLUMNS``, the same kernels seen from the other
side).

It costs time only in forwards with fewer than :data:`MIN_ROWS` rows. A 1536 × 576
product over 2 rows took 183 µs, and 568 µs over 16. A SmolLM2 request with one
candidate and R = 2 (a 300-token prompt, T = 16, W = 15) took 1.35× as long, 4 runs
alternated. So only a service that decodes requests together pads
(``Engine.make_batch_invariant``, called with ``--max-batch-requests`` above 1;
``/info``'s ``padded_linears``). A
server that runs one request at a time, the CPU default, never puts a request's rows
beside another's, and pays nothing.

CUDA is left as it is. cuBLAS also picks its kernels by shape, and whether a row's
bits there depend on the row count has not been measured here (no GPU was lent).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

__all__ = ["MIN_ROWS", "at_least", "pad_linear_rows"]

#: the fewest rows a CPU linear product takes (zero rows added below; see the module)
MIN_ROWS = 16

_PADDED = "_kvdiv_padded_rows"


def pad_linear_rows(model: torch.nn.Module) -> int:
    """Give the plain ``nn.Linear`` layers of ``model``'s decoder body at least
    :data:`MIN_ROWS` rows per product where their weights are on the CPU; returns how
    many layers do (0 on CUDA). Idempotent. Subclasses (quantized linears) keep their
    own forward; the output layer is the float32 head's (already padded)."""
    body = getattr(model, "model", model)
    count = 0
    for module in body.modules():
        if type(module) is not torch.nn.Linear or module.weight.device.type != "cpu":
            continue
        if not getattr(module, _PADDED, False):
            module.forward = types.MethodType(_padded_forward, module)
            setattr(module, _PADDED, True)
        count += 1
    return count


def at_least(x: torch.Tensor, rows: int) -> torch.Tensor:
    """(n, H) ``x`` with zero rows appended up to ``rows`` (``x`` itself when it has as many)."""
    return x if x.shape[0] >= rows else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def _padded_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // self.in_features
    if rows >= MIN_ROWS or rows == 0:
        return F.linear(x, self.weight, self.bias)
    padded = at_least(x.reshape(rows, self.in_features), MIN_ROWS)
    return F.linear(padded, self.weight, self.bias)[:rows].reshape(*x.shape[:-1], -1)

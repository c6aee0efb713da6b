"""The stacked prompt part on FlexAttention against the engine's kernel, on the device at hand.

A decoding step's prompt part (``gen_service.attention.cascade.stacked_cascade_attention``)
attends, for G stacked groups, each group's query block (rows × GQA ratio queries per KV
head) to that group's prompt, in one call: the prompts sit in one pool padded to the
longest (on the CPU rounded up to the kernel's 512-key blocks) with the padding masked.
The engine's kernel (:func:`gen_service.attention.cascade.prompt_kernel`: "cpu-flash" on
the CPU; on CUDA the explicit softmax when masked) reads every padded slot. FlexAttention
(``torch.nn.attention.flex_attention``, compiled) takes a block mask from the groups'
lengths and skips the padded blocks.

For each shape, both ways are called in turn (after a warm-up that includes the
compilation, timed apart), and each output is compared with a float64 softmax. Prints one
table: ms per call (medians), the ratio, the largest error against float64, and the
one-time compilation. The cascade merges the prompt part with the rows' own part by the
log-sum-exp, so FlexAttention is asked for it; where it cannot give it (torch 2.13 on
the CPU: "return_lse is not supported yet"), it is timed without and the table says so.

Usage: ``python benchmarks/bench_flex_attention.py [--device cpu] [--dtype float32]
[--calls 20]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402

import torch  # noqa: E402
from common import clock, interleaved  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from gen_service.attention.cascade import _prompt_part, prompt_kernel  # noqa: E402
from gen_service.attention.shared_cache import pooled_length  # noqa: E402

#: (name, groups, rows per group, the groups' prompt lengths): SmolLM2's heads (3 KV
#: heads of 64, GQA ratio 3). The demo's stack (4 policies' Q sides and P's, 8 rows),
#: the paper's grouped request (4 candidates + the control, P and Q sides, R = 16, a
#: 4k prompt) and a batch of 8 such requests' P sides at different lengths.
SHAPES = [
    ("demo stack, 8 groups", 8, 8, [250, 250, 325, 450, 500, 500, 500, 500]),
    ("grouped request, 4k prompt", 10, 16, [4000, 2000, 2000, 1000, 3600] + [4000] * 5),
    ("8 requests, 1-4k prompts", 8, 16, [1000, 1400, 1800, 2200, 2600, 3000, 3400, 4000]),
]
KV_HEADS, GQA, HEAD_DIM = 3, 3, 64


def inputs(groups: int, rows: int, lengths: list[int], device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    L = pooled_length(max(lengths), device)     # as the engine pools them
    q = torch.randn(groups, KV_HEADS, rows * GQA, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(groups, KV_HEADS, L, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.tensor(lengths, device=device)
    pad = (torch.arange(L, device=device)[None, :] >= lens[:, None])[:, None, :]     # (G, 1, L)
    return q, k, v, lens, pad


def within(lens: torch.Tensor):
    """FlexAttention's mask_mod: group b's keys below its prompt's length."""
    return lambda b, h, q_idx, kv_idx: kv_idx < lens[b]


def reference(q, k, v, pad, scaling):
    s = (q.double() @ k.double().transpose(-1, -2)) * scaling
    s = s.masked_fill(pad[:, :, None, :], float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def measure(flex, groups: int, rows: int, lengths: list[int], device: torch.device, dtype: torch.dtype,
            calls: int) -> dict:
    """One shape: both ways' median seconds per call, errors against float64, the compilation."""
    scaling = HEAD_DIM ** -0.5
    q, k, v, lens, pad = inputs(groups, rows, lengths, device, dtype)
    block = create_block_mask(within(lens), groups, None, q.shape[-2], k.shape[-2], device=device)
    lse, note = True, "with its log-sum-exp"
    t0 = clock(device)
    try:
        flex(q, k, v, block_mask=block, scale=scaling, return_lse=True)
    except Exception as exc:      # the cascade merge needs the log-sum-exp: say so, time without it
        lines = str(exc).strip().splitlines()
        why = next((ln for ln in lines if "not supported" in ln), lines[0])
        lse, note = False, "**without** its log-sum-exp: " + why.strip()[:160]
        flex(q, k, v, block_mask=block, scale=scaling)
    compile_s = clock(device) - t0

    def flexed() -> tuple[torch.Tensor, ...]:
        out = flex(q, k, v, block_mask=block, scale=scaling, return_lse=lse)
        return out if lse else (out,)

    ways = {"engine": lambda: _prompt_part(q, k, v, scaling, hidden=pad), "flex": flexed}
    out = interleaved(ways, calls, device)
    want = reference(q, k, v, pad, scaling)
    out |= {f"err_{name}": (fn()[0].double() - want).abs().max().item() for name, fn in ways.items()}
    shape = f"{groups} × {q.shape[-2]} × {k.shape[-2]} ({sum(lengths) / (groups * k.shape[-2]):.0%})"
    return out | {"compile": compile_s, "shape": shape, "note": note}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    flex = torch.compile(flex_attention, dynamic=False)
    kernel = prompt_kernel(device, dtype, HEAD_DIM, masked=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}, {args.dtype}; "
          f"the engine's masked prompt kernel here: {kernel}\n")
    print("| shape | G × queries × pool keys (kept) | engine ms | flex ms | engine ÷ flex | "
          "engine max err | flex max err | flex compile s |\n|---|---|---|---|---|---|---|---|")
    notes = set()
    for name, groups, rows, lengths in SHAPES:
        r = measure(flex, groups, rows, lengths, device, dtype, args.calls)
        notes.add(r["note"])
        print(f"| {name} | {r['shape']} | {r['engine'] * 1e3:.2f} | {r['flex'] * 1e3:.2f} | "
              f"**{r['engine'] / r['flex']:.2f}** | {r['err_engine']:.1e} | {r['err_flex']:.1e} | "
              f"{r['compile']:.1f} |")
    print("\nflex timed " + "; ".join(sorted(notes)))


if __name__ == "__main__":
    main()

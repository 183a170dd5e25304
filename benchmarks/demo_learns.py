"""`make demo` from a fresh clone, as a new user runs it (issue 30, part 1): its wall time with the install, the VAE's
reconstruction PSNR on the training clips, and how much closer the trained DiT's video of a training caption comes
to that caption's clip than a random-init DiT's does.

Run (it starts Ray, so under the machine-wide lock; ~5 min with the install):
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/demo_learns.py [--runs 1] [--keep]

Each run clones this repository's HEAD (`git clone`, so commit first) into a temp folder and times `make demo`
there: the venv, the install (the torch wheel from this machine's disk, the rest from the package registry or
pip's cache), prepare, `train-vae`, the DiT, generation and the side-by-side pictures. The PSNRs are seeded (the
same every run of one commit); the wall time moves with the machine's load and pip's cache (the first install on a
machine downloads more). With `--runs N` the figures are medians and `details` holds every run.

Figures (the last stdout line, one JSON object):
- `vae_reconstruction_psnr_db` >= 20: the VAE's PSNR on the training clips (64x64), from the demo's summary;
- `generated_psnr_margin_db` >= 3: PSNR of the trained DiT's video against its caption's training clip, minus the
  random-init DiT's (same VAE, prompt and seed);
- `fresh_clone_make_demo_s` <= 300: `make demo` in a fresh clone, install included.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _figures import fill_misses  # noqa: E402

GOALS = {"vae_reconstruction_psnr_db": ("dB", ">= 20"), "generated_psnr_margin_db": ("dB", ">= 3"),
         "fresh_clone_make_demo_s": ("s", "<= 300")}


def run_once(keep: bool) -> dict[str, float]:
    """Clone, `make demo`, parse the summary; returns the three figures of this run."""
    workdir = Path(tempfile.mkdtemp(prefix="vidray-demo-bench-"))
    try:
        subprocess.run(["git", "clone", "-q", str(REPO), str(workdir / "vidray")], check=True)
        started = time.perf_counter()
        out = subprocess.run(["make", "demo"], cwd=workdir / "vidray", capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - started
        if out.returncode != 0:
            raise RuntimeError(f"make demo exited {out.returncode}: {(out.stdout + out.stderr)[-2000:]}")
        summary = out.stdout[out.stdout.index("== summary"):]
        print(summary, flush=True)
        vae = re.search(r"VAE reconstruction PSNR on \d+ training clips: ([\d.]+) dB", summary)
        compared = re.search(r"trained DiT ([\d.]+) dB, random-init DiT ([\d.]+) dB", summary)
        if not (vae and compared):
            raise RuntimeError(f"no PSNR lines in the demo's summary: {summary}")
        return {"vae_reconstruction_psnr_db": float(vae.group(1)),
                "generated_psnr_margin_db": float(compared.group(1)) - float(compared.group(2)),
                "fresh_clone_make_demo_s": wall}
    finally:
        if keep:
            print(f"kept {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the clone (outputs/ holds the demo's pictures)")
    args = parser.parse_args()
    runs, figures = [], {}
    try:
        for i in range(args.runs):
            runs.append(run_once(args.keep))
            print(f"run {i + 1}: {runs[-1]}", flush=True)
        for name, (unit, goal) in GOALS.items():
            values = [r[name] for r in runs]
            figures[name] = {"value": round(statistics.median(values), 2), "unit": unit, "goal": goal,
                             **({"spread": [round(min(values), 2), round(max(values), 2)]} if len(values) > 1 else {})}
    except Exception as err:  # a figure not measured is a miss with its reason
        fill_misses(figures, GOALS, f"{type(err).__name__}: {err}")
    print(json.dumps({"benchmark": "demo_learns", "figures": figures, "details": {"runs": runs}}))


if __name__ == "__main__":
    main()

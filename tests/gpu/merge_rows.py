"""Merge the GPU run's scripts' JSON lines into the one JSON line `tests/gpu/run.sh` ends with.

`python tests/gpu/merge_rows.py OUT_DIR`: OUT_DIR holds `<script>.log` (the script's stdout and stderr) and
`<script>.rc` (its exit status; 124 when run.sh's deadline stopped it) per script. Each script prints
`{"benchmark": ..., "figures": {...}, "details": {...}}` as its last JSON line (`benchmarks/_figures.py`). The
merged line holds every script's figures (a name two scripts share gets the benchmark's name as a prefix), their
details by benchmark, and for a script that printed no JSON line a figure `<script>_run` that is a miss naming why
(the deadline, or its exit status and last output line), so that no row is silently absent.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._figures import miss  # noqa: E402


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of `text` that parses as a JSON object with "figures", or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("figures"), dict):
                return row
    return None


def merge(out_dir: Path) -> dict[str, Any]:
    """The merged row of every `<script>.log` in `out_dir` (sorted by the order run.sh wrote them: `order.txt`,
    else by name)."""
    order = out_dir / "order.txt"
    names = order.read_text().split() if order.exists() else sorted(p.stem for p in out_dir.glob("*.log"))
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {}
    scripts: dict[str, Any] = {}
    for name in names:
        log = out_dir / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        rc_file = out_dir / f"{name}.rc"
        rc = int(rc_file.read_text().strip() or -1) if rc_file.exists() else None
        wall = out_dir / f"{name}.wall"
        scripts[name] = {"rc": rc, "wall_s": float(wall.read_text()) if wall.exists() else None}
        row = last_json(text)
        if row is None:
            if rc is None:
                reason = "not run: run.sh's deadline passed before it"
            elif rc in (124, 137):
                reason = "stopped by run.sh's deadline (GPU_RUN_DEADLINE_S, 470 s by default) before printing its figures"
            else:
                tail = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "no output")
                reason = f"exited {rc} without figures: {tail.strip()[:240]}"
            figures[f"{name}_run"] = miss(reason, unit="s")
            continue
        bench = row.get("benchmark", name)
        for key, figure in row["figures"].items():
            figures[f"{bench}.{key}" if key in figures else key] = figure
        details[bench] = row.get("details", {})
    return {"benchmark": "gpu", "figures": figures, "details": details, "scripts": scripts}


if __name__ == "__main__":
    print(json.dumps(merge(Path(sys.argv[1]))), flush=True)

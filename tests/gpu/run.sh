#!/usr/bin/env bash
# The GPU checks (issues 28 and 45) in one command, for when a GPU machine is lent (one H100/H200; CI never has one):
#   bash tests/gpu/run.sh --fetch-wheels   # here, once: .whl/ gets the wheels and the Ray pack; prints the carried size
#   bash tests/gpu/run.sh                  # there: <= 8 minutes; the last line is one JSON object of every row's figures
# The lent machine's python3 (3.12) has torch, peft, transformers and safetensors but not diffusers, pydantic, Ray or
# PyAV, and no package registry. .whl/ (git-ignored, carried with the working tree: `carry: [".whl"]`; tree + .whl
# must stay under 64 MiB, which --fetch-wheels checks) holds WHEELS below and the Ray pack
# (tests/gpu/raypack.py: Ray 2.60 for Train and Serve, PyAV, Serve's web stack, slimmed and xz-compressed);
# both are installed offline first. The rows, each a script printing one JSON line, run in this order until the
# deadline: ray_rows.py (Ray Train NCCL fit of the tiny job, Serve rendering on the GPU), memory_rows.py,
# plan_modes_check.py and inference_rows.py (the memory modes and the planner against them, when present), int4_rows.py (the int4 gradient hook over NCCL), parallel_rows.py (a video over 2 GPUs; a miss on 1 GPU), serve_parallel_rows.py (a Serve Denoiser
# replica spanning 2 GPUs, CFG and context parallel; a miss on 1 GPU), scale_check.py (issue 28's training at scale); then
# merge_rows.py prints the merged line. A row whose script ran out of time or failed is a miss saying so.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(diffusers==0.42.1 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0)
PACK=.whl/raypack-cp312.tar
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  .venv/bin/python -m pip download --quiet --dest .whl --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "${WHEELS[@]}"
  .venv/bin/python tests/gpu/raypack.py build --python-version 3.12 --out "$PACK"   # exit 1 if over 64 MiB
  ls -l .whl
  exit 0
fi
DEADLINE_S=${GPU_RUN_DEADLINE_S:-470}   # the whole run, installs included (the call's limit is 8 minutes)
PY="${PYTHON:-python3}"
if [[ -d .whl ]] && ! "$PY" -c "import diffusers, pydantic" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-index --find-links .whl --no-deps .whl/*.whl
fi
if [[ -f "$PACK" ]] && ! "$PY" -c "import ray, av, fastapi" 2>/dev/null; then
  "$PY" tests/gpu/raypack.py install "$PACK" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUTS=$(mktemp -d)
ROWS=(tests/gpu/ray_rows.py tests/gpu/memory_rows.py tests/gpu/plan_modes_check.py tests/gpu/inference_rows.py tests/gpu/int4_rows.py tests/gpu/parallel_rows.py tests/gpu/serve_parallel_rows.py tests/gpu/scale_check.py)
for script in "${ROWS[@]}"; do
  [[ -f "$script" ]] || continue
  name=$(basename "$script" .py)
  echo "$name" >>"$OUTS/order.txt"
  left=$((DEADLINE_S - SECONDS))
  ((left > 10)) || continue   # merge_rows reports it as not run
  args=()
  [[ "$name" == scale_check ]] && args=("$@")
  start=$SECONDS
  set +e
  timeout -k 10 "$left" "$PY" "$script" "${args[@]}" >"$OUTS/$name.log" 2>&1
  echo $? >"$OUTS/$name.rc"
  set -e
  echo $((SECONDS - start)) >"$OUTS/$name.wall"
  tail -n 3 "$OUTS/$name.log" | cut -c1-400 >&2
done
exec "$PY" tests/gpu/merge_rows.py "$OUTS"

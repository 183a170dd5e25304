#!/usr/bin/env bash
# The GPU checks of issue 28 in one command, for when a GPU machine is lent (one H200; CI never has one):
#   bash tests/gpu/run.sh            # <= 8 minutes; the last line is one JSON object of figures
# The lent machine's python3 has torch, peft, transformers and safetensors but not diffusers, pydantic or Ray:
# wheels in .whl/ (fetched here with `bash tests/gpu/run.sh --fetch-wheels`, git-ignored, carried with the
# working tree) are installed first. The part that needs Ray (the tiny job) reports a miss without it.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(diffusers==0.42.1 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0)
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  .venv/bin/python -m pip download --quiet --dest .whl --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "${WHEELS[@]}"
  ls .whl
  exit 0
fi
PY="${PYTHON:-python3}"
if [[ -d .whl ]] && ! "$PY" -c "import diffusers, pydantic" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-index --find-links .whl --no-deps .whl/*.whl
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec timeout 480 "$PY" tests/gpu/scale_check.py "$@"

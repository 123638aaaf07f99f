#!/usr/bin/env bash
# Creates the Tunix virtual environment used by benchmarks/bench_tunix.py:
#   bash benchmarks/tunix_env.sh            # -> .venv-tunix in the repo root
#   TUNIX_VENV=/some/dir bash benchmarks/tunix_env.sh
# Tunix gets its own environment because its pins (safetensors<0.8, its own transformers)
# conflict with the project's; the project's .venv is never touched.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TUNIX_VENV:-.venv-tunix}"
REQ=benchmarks/requirements-tunix.txt
STAMP="$VENV/.installed-tunix"
# Reinstall only when the pins changed since the last successful install.
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$REQ" ]; then
  echo "$VENV is up to date"
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -r "$REQ"
# Our package too, editable and without dependencies (the pins above hold the ones it needs):
# bench_tunix.py times our sampler in Tunix's process.
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import tunix, jax, grpo_jax.sampling; print('tunix ok, jax', jax.__version__)"
touch "$STAMP"

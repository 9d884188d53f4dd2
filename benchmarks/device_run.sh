#!/usr/bin/env bash
# One prepared run on a machine with one accelerator and a fresh Python (see benchmarks/device.py
# for what it measures; it finishes in under 9 minutes and says what it skipped).
#
#   bash benchmarks/device_run.sh [OUT] [ARGS]   # results in OUT (default: device-results/)
#
# ARGS go to benchmarks/device.py (`--only train,resume`: those steps alone).
#
# Packages: with a package registry, `pip install -e '.[cuda12,test]'`. Without one (a machine
# that reaches nothing), the wheels carried in .whl/ (README, "Running on an accelerator": the
# few the machine's image lacks) are installed with --no-index, and the image's own packages do
# the rest. Nothing here assumes a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-device-results}"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then OUT="$1"; shift; fi  # OUT, unless a flag comes first
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

if "$PY" -m pip install -q --retries 0 --timeout 5 -e '.[cuda12,test]' >"$OUT/install.log" 2>&1; then
  echo "installed .[cuda12,test]"
elif [ -d .whl ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/jaxckpt-site .whl/*.whl >>"$OUT/install.log" 2>&1; then
  export PYTHONPATH="/tmp/jaxckpt-site${PYTHONPATH:+:$PYTHONPATH}"
  echo "no package registry: installed the wheels in .whl/ ($(ls .whl | tr '\n' ' '))"
else
  echo "SKIPPED install: no package registry and no usable .whl/; the image's packages are used"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import jax; print("jax", jax.__version__, "on", jax.devices())'
exec "$PY" -m benchmarks.device --out "$OUT" "$@"

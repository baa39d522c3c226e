#!/usr/bin/env bash
# One device run of benchmarks/kernels_gpu.py on a lent GPU (see "Device run" in
# pallas_kernels/kda/README.md). Device call: command `bash benchmarks/device_kernels.sh`,
# carry [".whl"] (the fla-core wheel), timeout_s ~540. Results: $OUT/kernels-gpu.{json,log}.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kernels-gpu-out}"
mkdir -p "$OUT" benchmarks/results
LOG="$OUT/kernels-gpu.log"
if ls .whl/*.whl >/dev/null 2>&1; then      # fla-core (pure Python), carried from here
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
# k3jax is not installed there: import pallas_kernels from the repo root (needs jax, numpy, flax)
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ date -u; nvidia-smi -L; python3 -m pip list 2>/dev/null \
    | grep -iE '^(jax|torch|triton|fla|einops|flax|numpy)'; } >"$LOG" 2>&1
# hard stop before the device call's own limit; the JSON is rewritten after every case
timeout 400 python3 benchmarks/kernels_gpu.py --out "$OUT/kernels-gpu.json" "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
cp "$OUT/kernels-gpu.json" benchmarks/results/kernels-gpu.json 2>/dev/null
echo "exit status $rc" | tee -a "$LOG"
exit "$rc"

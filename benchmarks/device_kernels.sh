#!/usr/bin/env bash
# One device run of benchmarks/kernels_gpu.py on a lent GPU (see "Device run" in
# pallas_kernels/kda/README.md). Device call: command `bash benchmarks/device_kernels.sh`,
# carry [".whl"] (the fla-core wheel), timeout_s ~590. Four phases, each its own process with
# its own time limit and a per-case watchdog, so one case that never finishes compiling costs
# only its phase: decode + MoE + MLA, then KDA prefill, then the pooled decode kernel's
# (block_v, num_warps) sweep, then the IEEE-fp32 checks.
# Results: $OUT/kernels-gpu-{decode,prefill,sweep,fp32}.json, merged into $OUT/kernels-gpu.json, and
# $OUT/kernels-gpu.log.
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
phase() {  # name, wall limit (s), per-case limit (s), case regex
  echo "== phase $1 (limit $2 s, $3 s per case): $4" | tee -a "$LOG"
  timeout "$2" python3 benchmarks/kernels_gpu.py --out "$OUT/kernels-gpu-$1.json" \
    --time-budget $(( $2 - 40 )) --case-timeout "$3" --cases "$4" 2>&1 | tee -a "$LOG"
  echo "phase $1 exit status ${PIPESTATUS[0]}" | tee -a "$LOG"
  cp "$OUT/kernels-gpu-$1.json" "benchmarks/results/kernels-gpu-$1.json" 2>/dev/null
}
phase decode "${K3_PHASE_DECODE_S:-130}" 60 \
  '^(check_kda_recurrent|check_kda_pool|kda_decode_pool_B|check_gmm_(bfloat16|mxfp4)|moe_gmm|check_mla_(bfloat16|fp8)|mla_paged)'
# per shape three cases, each with its own 150 s watchdog and JSON write: kda_prefill_* (the default
# kernel, fla fp32 / bf16, 2 other precisions, XLA's reference), kda_prefill_forms_* (4 split / staged
# variants, the staged form's stages alone) and kda_prefill_prepk_* (staged and split with the prep
# kernels), T = 8192 first
phase prefill "${K3_PHASE_PREFILL_S:-270}" 150 '^(check_kda_chunk|kda_prefill_(forms_|prepk_)?H96_T(1024|4096|8192))'
phase sweep "${K3_PHASE_SWEEP_S:-80}" 60 '^kda_decode_pool_sweep_B'
phase fp32 "${K3_PHASE_FP32_S:-70}" 60 '^(check_gmm_float32|check_mla_float32|kda_prefill_H8_)'
python3 benchmarks/kernels_gpu.py --out "$OUT/kernels-gpu.json" \
  --merge "$OUT"/kernels-gpu-{decode,prefill,sweep,fp32}.json 2>&1 | tee -a "$LOG"
cp "$OUT/kernels-gpu.json" benchmarks/results/kernels-gpu.json 2>/dev/null
exit 0

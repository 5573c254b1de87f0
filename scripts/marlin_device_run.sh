#!/usr/bin/env bash
# One H200 call for series commit 0006 (Marlin MoE 64-bit expert offsets), about
# 7 minutes, from the repository root with .bundle carried (docs/device-bundle.md):
#
#   1. kernel-time A/B, stock vs fixed kernel subset, NVFP4 and GPTQ int4,
#      M = 1, 8, 64, 512, 4608, every pinned tile and auto, stock/stock noise arm,
#      bitwise comparison (scripts/marlin_ab.py);
#   2. the 32 GiB bound on dense banks: stock at 8193 and 16385 rows (fault,
#      silent wrong read), fixed at 8193, 12000, 16385 and 20000 rows
#      (scripts/marlin_bound.py);
#   3. the base release's own Marlin MoE test cases (tests/kernels/moe/test_moe.py)
#      with moe_wna16_marlin_gemm redirected to the fixed subset build
#      (harness/marlin_pytest.py), then the series' kernel tests (capability
#      query, sparse > 32 GiB banks on virtual memory, format without 64-bit
#      kernels rejected).
#
# Its run of 2026-12-01 is results/marlin/b64-flag/h200/ (README beside it).
# The bundle must carry the two libraries as namespaces marlin_base and
# marlin_series, built with the default formats (see FORMATS). Everything lands
# in $OUT/h19.tgz; the two results.json files also come back unpacked.
set -u -o pipefail
: "${OUT:?set OUT to the output folder}"
P=/tmp/vllm-bundle
R=/tmp/h19-marlin
rm -rf "$R"
mkdir -p "$R"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_COMPILE_DISABLE=1 PYTHONPATH=$PWD
BASE=$P/py/kernels/marlin_base/libmarlin_base.so:marlin_base
FIX=$P/py/kernels/marlin_series/libmarlin_series.so:marlin_series
FORMATS="nvfp4:bf16,fp16 fp8:fp16 gptq4:fp16 awq4:fp16 mxfp4:bf16 mxfp8:bf16"
START=$(date +%s)
nvidia-smi > "$R/smi.txt" 2>&1

# Phase 1: A/B and bound (replays), no pytest.
python3 .bundle/device_run.py --out "$R/kernels" --skip-smoke --skip-tests --time-limit 230 \
  --replay "scripts/marlin_ab.py --stock $BASE --fixed $FIX --out $R/ab" \
  --replay "scripts/marlin_bound.py --lib stock=$BASE --rows 8193 16385 --timeout 60 --out $R/bound_stock" \
  --replay "scripts/marlin_bound.py --lib fixed=$FIX --rows 8193 12000 16385 20000 --timeout 60 --out $R/bound_fixed" \
  2>&1 | tee "$R/kernels.log"

# Phase 2: vLLM's Marlin MoE tests and the series' kernel tests against the fixed build.
LEFT=$((440 - $(date +%s) + START))
export VLLM_TEST_MARLIN_MOE_LIB=$FIX VLLM_TEST_MARLIN_MOE_FORMATS=$FORMATS
M=tests/kernels/moe
python3 .bundle/device_run.py --out "$R/tests" --skip-smoke --time-limit "$LEFT" \
  --pytest-timeout "$((LEFT - 15))" --pytest-arg=-p --pytest-arg=harness.marlin_pytest \
  -k "not test_large_bank_every_row_addressed" \
  --test $M/test_marlin_moe_capability.py --test $M/test_marlin_moe_large_bank.py \
  --test $M/test_moe.py::test_fused_marlin_moe --test $M/test_moe.py::test_fused_marlin_moe_with_bias \
  --test $M/test_moe.py::test_fused_marlin_moe_non_gated --test $M/test_moe.py::test_batched_fused_marlin_moe \
  2>&1 | tee "$R/tests.log"

echo "total $(($(date +%s) - START)) s" | tee -a "$R/tests.log"
tar -czf "$OUT/h19.tgz" -C "$R" .
cp "$R/kernels/results.json" "$OUT/kernels-results.json" 2>/dev/null
cp "$R/tests/results.json" "$OUT/tests-results.json" 2>/dev/null
exit 0

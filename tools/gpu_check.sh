#!/usr/bin/env bash
# The GPU tests, on the device machine (after `source .devbundle/env.sh`): each file under its own
# time limit, then one summary line per file (pytest's counts, or TIMED OUT), so that a run that
# is cut short shows which files it never finished. Exits non-zero if any file failed, timed out
# or collected nothing.
#
#   bash tools/gpu_check.sh                      # every GPU test file, 240 s each
#   GPU_CHECK_SECONDS=90 bash tools/gpu_check.sh packages/deepinfer-kernels/tests/test_gpu.py
#   GPU_CHECK_BUDGET=560 bash tools/gpu_check.sh # stop starting files after 560 s in all (the
#                                                  whole list takes longer than one 600 s device
#                                                  call): the summary ends with the command that
#                                                  runs the files left
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
limit=${GPU_CHECK_SECONDS:-240}
budget=${GPU_CHECK_BUDGET:-0}  # 0: no total limit
for setting in "GPU_CHECK_SECONDS=$limit" "GPU_CHECK_BUDGET=$budget"; do
  case ${setting#*=} in
    '' | *[!0-9]*) echo "${setting%%=*} must be a whole number of seconds, got '${setting#*=}'" >&2; exit 2 ;;
  esac
done
if [ $# -gt 0 ]; then
  files=("$@")
else
  k=packages/deepinfer-kernels/tests
  files=("$k"/test_gpu*.py
         "$k"/test_cuda_moe.py "$k"/test_cuda_prefill_gemm.py "$k"/test_cuda_decode_gemm.py "$k"/test_vendor.py
         packages/deepinfer-model/tests/test_cuda_graph.py
         packages/deepinfer-model/tests/test_moe_weight_order.py
         packages/deepinfer-sampling/tests/test_topk_triton.py
         packages/deepinfer-sampling/tests/test_sampler.py
         packages/deepinfer-sampling/tests/test_rng.py
         tests/test_engine_e2e.py)
fi

for f in "${files[@]}"; do
  if [ ! -f "$f" ]; then
    echo "no such test file: $f" >&2
    exit 2
  fi
done

summary=()
cut=()      # the file the budget cut short (at most one)
not_run=()  # the files after it, or once less than 30 s of the budget is left
failed=0
for f in "${files[@]}"; do
  file_limit=$limit
  if [ "$budget" -gt 0 ]; then
    remaining=$((budget - SECONDS))
    if [ ${#cut[@]} -gt 0 ] || [ ${#not_run[@]} -gt 0 ] || [ $remaining -lt 30 ]; then
      not_run+=("$f")
      continue
    fi
    [ $remaining -lt "$file_limit" ] && file_limit=$remaining
  fi
  echo "=== $f (limit ${file_limit}s) ==="
  start=$SECONDS
  # addopts' -q is dropped so that pytest prints its counts line, and -rfE names each failure
  out=$(timeout "$file_limit" python3 -m pytest -o addopts="" -q -rfE -p no:cacheprovider "$f" 2>&1)
  rc=$?
  echo "$out" | tail -25
  counts=$(echo "$out" | grep -E "^[0-9]+ (passed|failed|skipped|error)|^no tests ran" | tail -1)
  if [ $rc -eq 124 ] && [ "$file_limit" -lt "$limit" ]; then
    verdict="CUT (GPU_CHECK_BUDGET)"
    cut+=("$f")
  elif [ $rc -eq 124 ]; then verdict="TIMED OUT"
  elif [ $rc -eq 5 ]; then verdict="FAILED (collected no tests)"
  elif [ $rc -ne 0 ]; then verdict="FAILED (exit $rc)"
  else verdict=ok; fi
  [ "$verdict" = ok ] || failed=1
  summary+=("$(printf '%-62s %-12s %4ss  %s' "$f" "$verdict" $((SECONDS - start)) "$counts")")
done
echo
printf '%s\n' "${summary[@]}"
for f in "${not_run[@]}"; do printf '%-62s %s\n' "$f" "NOT RUN (GPU_CHECK_BUDGET)"; done
rest=("${cut[@]}" "${not_run[@]}")
if [ ${#rest[@]} -gt 0 ]; then
  echo "the rest: bash tools/gpu_check.sh ${rest[*]}"
  failed=1
fi
exit $failed

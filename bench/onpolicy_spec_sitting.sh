#!/usr/bin/env bash
# True on-policy and speculation on one GPU, one call, each part under its own time limit (LIMITS,
# seconds, in this order; 0 skips a part), so that a short device lease still brings back the first:
#   1. (TESTS, by default) tests/gpu/test_true_on_policy_gpu.py (the default plain-PyTorch forms and the Triton kernels,
#      dense and MoE with routing replay, chunked prefill), tests/gpu/test_speculative_gpu.py and tests/gpu/test_sdpa_gpu.py
#      (and EXTRA_TESTS);
#   2. bench.true_on_policy --part cost with the Triton kernels (COST_ONLY=train|decode: one half; the
#      train step at each of its default shapes);
#   3. bench.spec_gpu --profile at the 0.5B shapes (in process, PROFILE_BATCHES: ms per token of a
#      request, cProfile at the largest);
#   4. bench.spec_gpu at the 0.5B shapes (decode tok/s with and without NEXTN at batch 1/8/32/256,
#      SPEC_BRACKETS of random / oracle, SPEC_ARMS of nextn / adaptive / default).
#   5. bench.spec_gpu --longtail: one long-tailed rollout (256 requests, Pareto(0.8) lengths from 8 to
#      1024 new tokens) at SPEC_SIZES, plain against the recipe default.
#   [LIMITS="200 200 100 200 0"] bash bench/onpolicy_spec_sitting.sh OUT
set -u
out=${1:?usage: bench/onpolicy_spec_sitting.sh OUT}
read -r t_tests t_cost t_profile t_spec t_tail <<< "${LIMITS:-200 200 100 200 0}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
export USE_HUB_KERNELS=0  # transformers 5.25 asks the `kernels` package for hub kernels otherwise
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
git log --oneline -1 > "$out/commit.txt" 2>/dev/null

part() {  # name limit command...
  local name=$1 limit=$2
  shift 2
  [ "$limit" -gt 0 ] || return 0
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc $?"
  grep -E "passed|failed|PASSED|FAILED|^decode|^train step|^profile|^\| " "$out/$name.log" | tail -24
}

# shellcheck disable=SC2086
part tests "$t_tests" $py -m pytest -v -p no:cacheprovider -s \
  ${TESTS:-tests/gpu/test_true_on_policy_gpu.py tests/gpu/test_speculative_gpu.py tests/gpu/test_sdpa_gpu.py} ${EXTRA_TESTS:-}
only=()
[ -n "${COST_ONLY:-}" ] && only=(--only "$COST_ONLY")
part cost "$t_cost" $py -m bench.true_on_policy --part cost --kernels triton --model 0.5b --rounds 10 \
  --requests 64 --new 64 "${only[@]}" --out "$out/top_cost.json"
# shellcheck disable=SC2086
part profile "$t_profile" $py -m bench.spec_gpu --profile --sizes 0.5b --new 64 \
  --batches ${PROFILE_BATCHES:-1 8 32} --brackets ${SPEC_BRACKETS:-random oracle}
# shellcheck disable=SC2086
part spec "$t_spec" $py -m bench.spec_gpu --sizes ${SPEC_SIZES:-0.5b} --brackets ${SPEC_BRACKETS:-random oracle} \
  --arms ${SPEC_ARMS:-nextn adaptive default} \
  --out "$out/spec_gpu.json"
# shellcheck disable=SC2086
part longtail "${t_tail:-0}" $py -m bench.spec_gpu --longtail --sizes ${SPEC_SIZES:-0.5b} --batches 256 --new 1024 \
  --brackets ${SPEC_BRACKETS:-random oracle} --arms default --out "$out/longtail.json"

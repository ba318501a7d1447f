#!/usr/bin/env bash
# DeepSeek-V4 on the Megatron backend, one GPU, one call: the launcher's Megatron miniature (a GPU
# test), bench.deepseek_v4_gpu's mismatch part on Megatron (train step seconds, MFU, |delta log p|
# over STEPS GRPO steps with R3 off and on) and on FSDP (FSDP_STEPS, at most 10 by default: the step-time anchor), then
# the GPU tests of the V4 Megatron modules. Each part under its own time limit (LIMITS, seconds, in
# that order; 0 skips a part), so that a short device lease still brings back the first ones.
#   [LIMITS="150 200 110 120"] [REPLAY="off rollout"] bash bench/v4_megatron_sitting.sh OUT [STEPS [FSDP_STEPS]]
# Seen on one H100 (2026-12-07): a Megatron run of 20 steps takes ~165 s with its start-up, an FSDP run
# of 5 steps ~45 s; REPLAY=rollout runs only the R3 arm.
set -u
out=${1:?usage: bench/v4_megatron_sitting.sh OUT [STEPS]}
steps=${2:-20}
fsdp_steps=${3:-$(( steps < 10 ? steps : 10 ))}
read -r t_launcher t_megatron t_fsdp t_tests <<< "${LIMITS:-150 200 110 120}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
export USE_HUB_KERNELS=0  # transformers 5.25 asks the `kernels` package for hub kernels otherwise
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"

tests() {  # name limit pytest-args...
  local name=$1 limit=$2
  shift 2
  [ "$limit" -gt 0 ] || return 0
  timeout "$limit" $py -m pytest -q -p no:cacheprovider -s "$@" > "$out/$name.log" 2>&1
  echo "$name rc $?"
  grep -E "rel err|passed|failed|^[123] \{|Error" "$out/$name.log" | grep -v Warning | tail -12
}

bench() {  # backend limit steps
  [ "$2" -gt 0 ] || return 0
  timeout "$2" $py -m bench.deepseek_v4_gpu --part mismatch --backend "$1" --steps "$3" --replay ${REPLAY:-off rollout} \
    --workdir /tmp/bv4 --out "$out/v4_$1.json" > "$out/bench_$1.log" 2>&1
  echo "bench $1 rc $?"
  grep -E "^\| (megatron|fsdp) " "$out/bench_$1.log"
  # every run's per-step metrics, also of a run the time limit cut short
  (cd /tmp/bv4/runs && tar czf "$out/metrics_$1.tgz" v4-mismatch-"$1"-*/metrics.jsonl)
}

tests launcher "$t_launcher" tests/gpu/test_deepseek_launcher_gpu.py
bench megatron "$t_megatron" "$steps"
bench fsdp "$t_fsdp" "$fsdp_steps"
tests v4_tests "$t_tests" tests/gpu/test_megatron_deepseek_gpu.py -k v4

#!/usr/bin/env bash
# DeepSeek-V4 on the Megatron backend, one GPU, one call: the GPU tests of the V4 Megatron modules and
# the launcher's miniature, then bench.deepseek_v4_gpu's mismatch part on Megatron (train step seconds,
# MFU, |delta log p| over STEPS GRPO steps with R3 off and on) and on FSDP (at most 10 steps: the
# step-time anchor). Logs and JSON to OUT.
#   bash bench/v4_megatron_sitting.sh OUT [STEPS]
set -u
out=${1:?usage: bench/v4_megatron_sitting.sh OUT [STEPS]}
steps=${2:-20}
mkdir -p "$out"
py=${PYTHON:-python3}
export USE_HUB_KERNELS=0  # transformers 5.25 asks the `kernels` package for hub kernels otherwise
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 $py -m pytest -q -p no:cacheprovider -s tests/gpu/test_megatron_deepseek_gpu.py \
  tests/gpu/test_deepseek_launcher_gpu.py -k "v4 or launcher" > "$out/tests.log" 2>&1
echo "tests rc $?"
grep -E "rel err|passed|failed|^[123] \{|Error" "$out/tests.log" | grep -v Warning | tail -20
declare -A limit=([megatron]=170 [fsdp]=110)
declare -A nsteps=([megatron]=$steps [fsdp]=$(( steps < 10 ? steps : 10 )))  # FSDP: the step-time anchor
for backend in megatron fsdp; do
  timeout "${limit[$backend]}" $py -m bench.deepseek_v4_gpu --part mismatch --backend "$backend" --steps "${nsteps[$backend]}" \
    --workdir /tmp/bv4 --out "$out/v4_$backend.json" > "$out/bench_$backend.log" 2>&1
  echo "bench $backend rc $?"
  grep -E "^\| (megatron|fsdp) " "$out/bench_$backend.log"
done

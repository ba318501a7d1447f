#!/usr/bin/env bash
# Everything that needs two GPUs of one host, in one command (run it when a two-GPU machine is lent):
#   bash bench/multi_gpu_sitting.sh OUT [tests|figures|all]      (default all; split over two calls
#                                                                  when one call's limit is short)
# tests:   every test marked `gpu2` (tests/conftest.py skips them on fewer GPUs): Megatron TP=2 / PP=2 /
#          DP=2 / EP=2 against one rank, LoRA layouts, resuming in another layout, the NCCL flight
#          recorder's dump of a hung collective, the disaggregated loop learning over NCCL.
# figures: bench.e2e_gpu's GRPO step with the engine on GPU 0 and the trainer on GPU 1 (fully async,
#          weights broadcast over NCCL) against the colocated layout in the same run (sync, and async
#          with both resident; weights by CUDA IPC), same model, batch and lengths.
# Logs, JUnit XML and JSON land in OUT.
set -u
out=${1:?usage: bench/multi_gpu_sitting.sh OUT [tests|figures|all]}
part=${2:-all}
py=${PYTHON:-python3}
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
gpus=$($py -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -lt 2 ]; then
  echo "this host shows $gpus GPU(s); the sitting needs 2" >&2
  exit 2
fi
rc=0
if [ "$part" = tests ] || [ "$part" = all ]; then
  timeout 540 $py -m pytest -q -p no:cacheprovider -m gpu2 tests/gpu --junitxml "$out/gpu2.xml" \
    > "$out/gpu2_tests.log" 2>&1 || rc=1
  tail -5 "$out/gpu2_tests.log"
fi
if [ "$part" = figures ] || [ "$part" = all ]; then
  for run in "colocated sync" "colocated async" "disaggregated async"; do
    set -- $run
    timeout 300 $py -m bench.e2e_gpu --layout "$1" --schedule "$2" --steps 6 --tag "-$1-$2" \
      --workdir /tmp/bench_e2e_2gpu --out "$out/e2e_$1_$2.json" > "$out/e2e_$1_$2.log" 2>&1 || rc=1
    tail -3 "$out/e2e_$1_$2.log"
  done
fi
exit $rc

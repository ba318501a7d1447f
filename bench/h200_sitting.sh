#!/usr/bin/env bash
# One sitting of the GPU figures quoted in README.md and bench/RESULTS.md, on one GPU, in this order:
#   1. the GPU tests: the whole tests/gpu directory in its own order, then the two memory tests in
#      another order (each after a test that leaves captured graphs or a trained backend behind);
#   2. three rounds of: TRL GRPOTrainer (HF generate, gradient checkpointing on), Miles colocated
#      sync GRPO (Megatron), TRL with gradient checkpointing off: the anchor in the same sitting,
#      interleaved so that a drift of the machine shows on both sides;
#   3. the engine's decode throughput, three runs;
#   4. FP8 against bf16 (bench/fp8_gpu.py, one run, its own 3 interleaved rounds): engine tok/s at
#      Qwen2.5-0.5B and 7B shapes (decode- and prefill-heavy, fp8_min_tokens at its default and at 1),
#      the FSDP train step (none / fake_quant / torchao_float8 when torchao is importable), and the
#      train-rollout log-prob mismatch over 20 GRPO steps (bf16; FP8 without / with the contract);
#   5. mixture of experts (bench/moe_gpu.py, one run, 3 interleaved rounds of decode): engine decode
#      tok/s of a Qwen3-30B-A3B-shaped MoE against the dense model of its active size, and the
#      mismatch over 20 GRPO steps with routing replay off and on.
# Usage, from the repository root, with megatron-core, TRL and the server packages importable:
#   bash bench/h200_sitting.sh OUT_DIR
# Every command's output goes to OUT_DIR/NAME.log (JSON summaries to OUT_DIR/NAME.json), the start
# and end of each (UTC, exit status) to OUT_DIR/sitting.log; OUT_DIR/DONE is written last.
set -u
out=${1:?usage: bench/h200_sitting.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python3}

step() {
    local name=$1
    shift
    echo "$(date -u +%FT%TZ) start $name: $*" >>"$out/sitting.log"
    "$@" >"$out/$name.log" 2>&1
    echo "$(date -u +%FT%TZ) end $name rc=$?" >>"$out/sitting.log"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    nproc
    $py -c 'import sys, torch, transformers, triton; print(sys.version); print(torch.__version__, transformers.__version__, triton.__version__)'
    $py -m pip list 2>/dev/null | grep -i -E '^(megatron-core|trl|datasets|pydantic|fastapi|uvicorn|accelerate|torchao) '
} >"$out/env.txt" 2>&1

pytest=($py -m pytest -q -p no:cacheprovider -rA -s)
step tests_dir "${pytest[@]}" tests/gpu
step tests_other_order "${pytest[@]}" \
    tests/gpu/test_fsdp_gpu.py::test_bf16_training_lowers_the_loss_on_a_fixed_batch \
    tests/gpu/test_engine_gpu.py::test_graph_decode_equals_eager \
    tests/gpu/test_fsdp_gpu.py::test_offload_frees_and_onload_restores_device_memory \
    tests/gpu/test_engine_gpu.py::test_release_and_resume_memory

for r in 1 2 3; do
    step "trl_gc_on_r$r" $py -m bench.trl_grpo --steps 3 --out "$out/trl_gc_on_r$r.json"
    step "e2e_sync_r$r" $py -m bench.e2e_gpu --layout colocated --backend megatron --steps 4 \
        --tag "r$r" --out "$out/e2e_sync_r$r.json"
    step "trl_gc_off_r$r" $py -m bench.trl_grpo --steps 3 --no-gradient-checkpointing \
        --out "$out/trl_gc_off_r$r.json"
done
for r in 1 2 3; do
    step "engine_r$r" $py -m bench.engine_gpu --skip-eager --skip-hf --out "$out/engine_r$r.json"
done
step fp8 $py -m bench.fp8_gpu --out "$out/fp8.json"  # models and runs in runs/bench_fp8 (7B: 15 GB)
step moe $py -m bench.moe_gpu --out "$out/moe.json"  # models and runs in runs/bench_moe (MoE: 16 GB)
date -u +%FT%TZ >"$out/DONE"

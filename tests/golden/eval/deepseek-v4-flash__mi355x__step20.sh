#!/bin/bash
#SBATCH --job-name=miles-eval-deepseek-v4-flash-step20
#SBATCH --output=/shared/runs/deepseek-v4-flash/eval/step_20/job/logs/slurm/%j_0_log.out
#SBATCH --error=/shared/runs/deepseek-v4-flash/eval/step_20/job/logs/slurm/%j_0_log.err
#SBATCH --time=105
#SBATCH --open-mode=append
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=128
#SBATCH --partition=mi355x

set -uo pipefail
RUN_DIR=/shared/runs/deepseek-v4-flash/eval/step_20/job
export GPU_MAX_HW_QUEUES=2
export HSA_NO_SCRATCH_RECLAIM=1
export PYTHONUNBUFFERED=1
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/control"
rm -f "$RUN_DIR/control/preempt"
echo "miles: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} run $RUN_DIR"

srun --kill-on-bad-exit=1 --export=ALL --container-image=/shared/containers/miles-rocm.sqsh --container-mounts=/shared:/shared,/local:/local,/shared/runs:/shared/runs --container-env=GPU_MAX_HW_QUEUES,HSA_NO_SCRATCH_RECLAIM,PYTHONUNBUFFERED --output="$RUN_DIR/logs/eval-%t.log" python -m miles.eval.runner snapshot --run-dir /shared/runs/deepseek-v4-flash --step 20 &
EVAL_PID=$!

# The first step to end decides: the eval step's status is the job's; any other step ending
# first fails the job at once. `wait -n` returns early when a trapped signal arrives.
while kill -0 "$EVAL_PID" 2>/dev/null; do wait -n; done
if ! kill -0 "$EVAL_PID" 2>/dev/null; then
  wait "$EVAL_PID"; STATUS=$?
  echo "miles: eval step exited with $STATUS"
  [ "$STATUS" -eq 0 ] || tail -v -n 12 "$RUN_DIR/logs/eval"-*.log 2>/dev/null | sed "s/^/  | /"
fi
exit "$STATUS"

#!/bin/bash
#SBATCH --job-name=miles-eval-slurm-tiny-step4
#SBATCH --output=/shared/runs/slurm-tiny/eval/step_4/job/logs/slurm/%j_0_log.out
#SBATCH --error=/shared/runs/slurm-tiny/eval/step_4/job/logs/slurm/%j_0_log.err
#SBATCH --time=45
#SBATCH --open-mode=append
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --partition=debug

set -uo pipefail
RUN_DIR=/shared/runs/slurm-tiny/eval/step_4/job
export PYTHONUNBUFFERED=1
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/control"
rm -f "$RUN_DIR/control/preempt"
echo "miles: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} run $RUN_DIR"

srun --kill-on-bad-exit=1 --export=ALL --output="$RUN_DIR/logs/eval-%t.log" python -m miles.eval.runner snapshot --run-dir /shared/runs/slurm-tiny --step 4 --mode external --fn my_evals:aime &
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

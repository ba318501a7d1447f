#!/bin/bash
#SBATCH --job-name=miles-coding-tiny
#SBATCH --output=<repo>/runs/coding-tiny/logs/slurm/%j_0_log.out
#SBATCH --error=<repo>/runs/coding-tiny/logs/slurm/%j_0_log.err
#SBATCH --time=60
#SBATCH --open-mode=append
#SBATCH --signal=B:USR2@120
#SBATCH --requeue
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=140
#SBATCH --partition=gb300
#SBATCH --segment=1
#SBATCH hetjob
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=35
#SBATCH --partition=gb300
#SBATCH --segment=1

set -uo pipefail
RUN_DIR=<repo>/runs/coding-tiny
export NCCL_CUMEM_ENABLE=1
export NCCL_IB_HCA=mlx5
export NCCL_MNNVL_ENABLE=2
export NCCL_NVLS_ENABLE=0
export NCCL_SOCKET_IFNAME='^lo,docker'
export PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=20000
export TORCH_FR_DUMP_TEMP_FILE="$RUN_DIR/logs/flight_recorder-"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$RUN_DIR/logs/flight_recorder-"
export TORCH_NCCL_DUMP_ON_TIMEOUT=1
export TORCH_NCCL_ENABLE_MONITORING=1
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=480
export TORCH_NCCL_TRACE_BUFFER_SIZE=20000
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/control"
rm -f "$RUN_DIR/control/preempt"
echo "miles: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} run $RUN_DIR"

# USR2 before the time limit: ask the loop for a checkpoint, let the actor step finish it, requeue.
on_usr2() {
  echo "miles: USR2 at $(date +%s): checkpoint requested, requeueing job $SLURM_JOB_ID"
  touch "$RUN_DIR/control/preempt"
  wait "$ACTOR_PID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}
trap on_usr2 USR2

srun --kill-on-bad-exit=1 --export=ALL --het-group=0 --cpus-per-task=140 --container-image=/shared/containers/miles-cuda-arm64.sqsh --container-mounts=/shared:/shared,/local:/local,<repo>/runs:<repo>/runs --container-env=NCCL_CUMEM_ENABLE,NCCL_IB_HCA,NCCL_MNNVL_ENABLE,NCCL_NVLS_ENABLE,NCCL_SOCKET_IFNAME,PYTHONUNBUFFERED,TORCH_FR_BUFFER_SIZE,TORCH_FR_DUMP_TEMP_FILE,TORCH_NCCL_ASYNC_ERROR_HANDLING,TORCH_NCCL_DEBUG_INFO_TEMP_FILE,TORCH_NCCL_DUMP_ON_TIMEOUT,TORCH_NCCL_ENABLE_MONITORING,TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC,TORCH_NCCL_TRACE_BUFFER_SIZE --output="$RUN_DIR/logs/rollout-%t.log" python -m miles.cluster.bootstrap rollout --run-dir "$RUN_DIR" &
ROLLOUT_PID=$!
srun --kill-on-bad-exit=1 --export=ALL --het-group=1 --cpus-per-task=35 --container-image=/shared/containers/miles-cuda-arm64.sqsh --container-mounts=/shared:/shared,/local:/local,<repo>/runs:<repo>/runs --container-env=NCCL_CUMEM_ENABLE,NCCL_IB_HCA,NCCL_MNNVL_ENABLE,NCCL_NVLS_ENABLE,NCCL_SOCKET_IFNAME,PYTHONUNBUFFERED,TORCH_FR_BUFFER_SIZE,TORCH_FR_DUMP_TEMP_FILE,TORCH_NCCL_ASYNC_ERROR_HANDLING,TORCH_NCCL_DEBUG_INFO_TEMP_FILE,TORCH_NCCL_DUMP_ON_TIMEOUT,TORCH_NCCL_ENABLE_MONITORING,TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC,TORCH_NCCL_TRACE_BUFFER_SIZE --output="$RUN_DIR/logs/actor-%t.log" python -m miles.cluster.bootstrap actor --run-dir "$RUN_DIR" -- python -m miles.loop --run-dir "$RUN_DIR" --resume &
ACTOR_PID=$!

# The first step to end decides: the actor step's status is the job's; any other step ending
# first fails the job at once. `wait -n` returns early when a trapped signal arrives.
while kill -0 "$ACTOR_PID" 2>/dev/null && kill -0 "$ROLLOUT_PID" 2>/dev/null; do wait -n; done
if ! kill -0 "$ACTOR_PID" 2>/dev/null; then
  wait "$ACTOR_PID"; STATUS=$?
  echo "miles: actor step exited with $STATUS"
  [ "$STATUS" -eq 0 ] || tail -v -n 12 "$RUN_DIR/logs/actor"-*.log 2>/dev/null | sed "s/^/  | /"
elif ! kill -0 "$ROLLOUT_PID" 2>/dev/null; then
  wait "$ROLLOUT_PID"; STATUS=$?
  echo "miles: rollout step exited with $STATUS before the actor step; stopping the job"
  [ "$STATUS" -ne 0 ] || STATUS=1
  tail -v -n 12 "$RUN_DIR/logs/rollout"-*.log 2>/dev/null | sed "s/^/  | /"
  kill -TERM "$ACTOR_PID" 2>/dev/null; wait "$ACTOR_PID" 2>/dev/null
fi
kill -TERM "$ROLLOUT_PID" 2>/dev/null; wait "$ROLLOUT_PID" 2>/dev/null
exit "$STATUS"

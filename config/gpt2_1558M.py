# GPT-2 XL (1.5B) on FineWeb-Edu; lr and 1M-token batch of GPT-3 XL. 10B tokens is short for
# this size: for the full run make the data with --name sample-100BT and raise max_steps.
# 8 GPUs (80 GB): torchrun --standalone --nproc_per_node=8 train_gpt2.py config/gpt2_1558M.py
data_root = "edu_fineweb10B"
log_dir = "log_1558M"
n_layer = 48
n_head = 25
n_embd = 1600
total_batch_size = 1048576  # 2**20
B = 8  # per GPU on 80 GB (8 GPUs: 16 micro-steps a step); 40 GB: 1; 24 GB: parallel="fsdp"; or "auto"
T = 1024
max_lr = 2e-4
min_lr = 2e-5
muon_lr = 6e-4  # with --optimizer=muon: 3x max_lr (docs/recipes.md)
warmup_steps = 358  # 375M tokens, as the smaller runs
max_steps = 9537  # 10B tokens

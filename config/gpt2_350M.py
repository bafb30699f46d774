# GPT-2 medium (350M) on FineWeb-Edu sample-10BT; lr and batch of GPT-3 Medium.
# 8 GPUs (80 GB): torchrun --standalone --nproc_per_node=8 train_gpt2.py config/gpt2_350M.py
data_root = "edu_fineweb10B"
log_dir = "log_350M"
n_layer = 24
n_head = 16
n_embd = 1024
total_batch_size = 524288
B = 32  # per GPU on 80 GB (8 GPUs: 2 micro-steps a step); 16 on 40 GB, 8 on 24 GB, or "auto"
T = 1024
max_lr = 3e-4
min_lr = 3e-5
muon_lr = 9e-4  # with --optimizer=muon: 3x max_lr (docs/recipes.md)
warmup_steps = 715
max_steps = 19073  # 10B tokens

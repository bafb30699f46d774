# GPT-2 large (774M) on FineWeb-Edu; lr and batch of GPT-3 Large. 10B tokens is short for this
# size: for the full run make the data with --name sample-100BT and raise max_steps.
# 8 GPUs (80 GB): torchrun --standalone --nproc_per_node=8 train_gpt2.py config/gpt2_774M.py
data_root = "edu_fineweb10B"
log_dir = "log_774M"
n_layer = 36
n_head = 20
n_embd = 1280
total_batch_size = 524288
B = 16  # per GPU on 80 GB (8 GPUs: 4 micro-steps a step); 8 on 40 GB, 2 on 24 GB, or "auto"
T = 1024
max_lr = 2.5e-4
min_lr = 2.5e-5
muon_lr = 7.5e-4  # with --optimizer=muon: 3x max_lr (docs/recipes.md)
warmup_steps = 715
max_steps = 19073  # 10B tokens

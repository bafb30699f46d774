# A small GPT on the offline demo corpus (python fineweb.py --demo): ~5 minutes on 2 CPU cores.
#   python fineweb.py --demo && python train_gpt2.py config/demo_cpu.py
data_root = "demo_stdlib"
log_dir = "log_demo"
# 7.4M parameters, 6.4M of them the GPT-2 token embedding (tied with the output layer)
n_layer = 4
n_head = 4
n_embd = 128
block_size = 256
T = 256
B = 16
total_batch_size = 4096  # one micro-batch per step on one process
max_steps = 400  # 1.6M tokens, over a quarter of the corpus
warmup_steps = 40
max_lr = 2e-3  # small models take a larger learning rate
min_lr = 2e-4
eval_interval = 50
val_tokens = 32768
sample_interval = 100
sample_prompt = "def "
sample_length = 48
checkpoint_interval = 100
dtype = "bfloat16"  # 1.3x faster than float32 on CPUs with bf16 units; use float32 on older CPUs
compile = False  # starts at once; compiling pays off only on long runs
cpu_reuse_memory = True  # ~1.6x faster on Linux for ~15% more peak memory (bench.py), fine at 7M

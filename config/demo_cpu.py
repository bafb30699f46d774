# A small GPT on the offline demo corpus (python fineweb.py --demo): under 5 minutes on 2 CPU
# cores, in float32 on an AVX2-only CPU (dtype="auto") as in bf16 on one with bf16 units.
#   python fineweb.py --demo && python train_gpt2.py config/demo_cpu.py
data_root = "demo_stdlib"
log_dir = "log_demo"
# 7.7M parameters, 6.4M of them the GPT-2 token embedding (tied with the output layer): the
# 50,304-way output is most of the work, so depth is cheap and width is not
n_layer = 6
n_head = 4
n_embd = 128
block_size = 256
T = 256
total_batch_size = 4096  # 16 sequences of 256
B = 16  # one micro-batch per step on one process (2 processes: --B=8, as the README says)
max_steps = 120  # 0.5M tokens
warmup_steps = 20
max_lr = 1.5e-3  # small models take a larger learning rate
min_lr = 1.5e-4
muon_lr = 4.5e-3  # with --optimizer=muon: 3x max_lr, the best of the sweep in docs/benchmarks.md
eval_interval = 40
val_tokens = 16384
sample_interval = 60
sample_prompt = "def"
sample_length = 48
checkpoint_interval = 60
hellaswag = False  # a model this small scores at chance; online, the eval would take longer than the run

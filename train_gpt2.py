"""
Train GPT-2 on FineWeb-Edu token shards, on one CPU/GPU or many GPUs.

    python train_gpt2.py                                   # one process: cuda, mps or cpu
    torchrun --standalone --nproc_per_node=8 train_gpt2.py # one node, 8 GPUs (DDP over NCCL)
    python train_gpt2.py config/NAME.py --max_steps=100 --dtype=float32

One run, top to bottom, as nanoGPT's train.py: the constants (edit them here, or override them with
config files and --key=value arguments); DDP setup from torchrun's environment; the model, the data
and the optimizer; then the loop, which evaluates, samples, checkpoints and takes one optimizer step
with gradient accumulation per iteration. The machinery each part calls lives in gptkit/: the data in
shards.py, checkpoints, preemption (SIGTERM: exit 75) and the one-line errors in checkpoint.py, the
waits between ranks in parallel.py, log.txt and run.json in run_record.py. The DDP parts: docs/ddp.md.
"""
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gptkit import checkpoint, configurator, cpu, hardware, run_record, shards, tokenizer
from gptkit.distributed import (agree, first_step_timeout, restart_store, set_collective_timeout,
                             set_rank_environment)
from gptkit.common import UserError
from gptkit.shards import DataLoaderLite
from model import GPT, GPTConfig, flops_per_token

# -----------------------------------------------------------------------------
# config: the defaults reproduce GPT-2 124M on 10B tokens of FineWeb-Edu (build-nanogpt's run)
# I/O
data_root = "edu_fineweb10B"  # folder of *_train_*.npy / *_val_*.npy uint16 shards (fineweb.py)
shuffle = True  # train shards and their documents in a fresh order each epoch, from seed; False: in order
log_dir = "log"  # log.txt, samples.txt and checkpoints go here
init_from = "scratch"  # "scratch", an OpenAI name (gpt2, gpt2-medium, ...) or a HF model directory
# model (ignored when init_from is not "scratch": the weights bring their own shape)
n_layer = 12  # transformer blocks
n_head = 12  # attention heads per block
n_embd = 768  # width: the size of each token's vector
block_size = 1024  # longest sequence the model can see
vocab_size = 50304  # GPT-2's vocabulary padded up to a multiple of 128, for faster matmuls
# batch: total_batch_size tokens per optimizer step = B * T * world_size * grad_accum_steps
total_batch_size = 524288  # 2**19, ~0.5M tokens, as GPT-3 124M
B = 64  # micro-batch, sequences per process: 64 fits 124M on 80 GB; halve it on a smaller GPU, or "auto"
T = 1024  # sequence length
# optimizer: AdamW, linear warmup then cosine decay to min_lr at max_steps (other recipes: docs/recipes.md)
max_lr = 6e-4  # the peak, reached at the end of warmup
min_lr = 6e-5  # where the decay ends, at max_steps: max_lr / 10
warmup_steps = 715  # 375M tokens, as GPT-3
max_steps = 19073  # 10B tokens / 2**19 per step: a little over one epoch of sample-10BT (see the start)
weight_decay = 0.1  # AdamW's, on the 2-D weights only (model.py: configure_optimizers)
grad_clip = 1.0  # clip the global gradient norm to this; 0 disables
lr_schedule = "cosine"  # "cosine", or "wsd": warmup, constant max_lr, then decay_shape to min_lr
decay_frac = 0.2  # wsd: the last 20% of max_steps decay
decay_shape = "linear"  # wsd: "linear" or "1-sqrt"
optimizer = "adamw"  # "adamw", or "muon": Muon for the blocks' weight matrices, AdamW for the rest
muon_lr = 1.8e-3  # muon: its peak lr, 3x max_lr (the quick start's best, docs/recipes.md), scheduled alike
muon_momentum = 0.95  # muon: Nesterov momentum
dropout = 0.0  # for finetuning: the fraction of activations dropped in training (GPT-2 pretrained with none)
# evaluation, samples, checkpoints (every N steps and at the last step; 0 turns it off)
eval_interval = 250  # val loss, bits per byte and HellaSwag
val_tokens = 10485760  # first 10M tokens of the val split, whatever the number of processes
sample_interval = 250  # 4 continuations of sample_prompt into samples.txt
sample_prompt = "Hello, I'm a language model,"  # what the samples continue
sample_length = 32  # new tokens in each of the 4 samples
checkpoint_interval = 1000  # 0: only at the last step (and on SIGTERM / too many bad steps)
keep_checkpoints = 3  # the newest N checkpoints are kept, older ones deleted; 0 keeps all
resume = "auto"  # "auto": continue from the newest valid checkpoint in log_dir, if any; "never": refuse one
max_bad_steps = 5  # non-finite loss or grad norm: skip the update; stop after this many in a row
hellaswag = True  # HellaSwag acc_norm at every eval (all ranks share the 10,042 val examples)
hellaswag_file = ""  # a HellaSwag jsonl file; "" = the val split, downloaded once into ./hellaswag/
# system
device = "auto"  # auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps; torchrun uses cuda:LOCAL_RANK
dtype = "auto"  # auto (what the hardware does fast, said at start), bfloat16, float16 (loss scaled), float32
compile = "auto"  # torch.compile the model: "auto" = on CUDA (slower start, faster steps); True, False
cpu_reuse_memory = True  # CPU on Linux: keep freed memory for reuse: faster steps, more peak RSS
parallel = "ddp"  # with torchrun: "ddp" (a whole copy of the state per GPU) or "fsdp" (sharded: docs/fsdp.md)
collective_timeout = 600  # seconds a rank waits for the others once the first step is done (docs/ddp.md, 10)
seed = 1337  # the init, the data's order, the samples
# Weights & Biases (rank 0; the numbers of log.txt): pip install -r requirements-wandb.txt
wandb_log = False  # also log to W&B
wandb_project = "gpt2"  # the W&B project
wandb_run_name = "gpt2-124M"  # the W&B run's name
DEFAULTS = {k: v for k, v in globals().items() if k[0] != '_' and type(v) in (bool, int, float, str)}
# From here on an error ends the run with one line (a bad config value, out of memory at B, a rank that
# stopped answering), and however the run ends its process group and log_dir are released.
checkpoint.one_line_errors(lambda: B)
config = configurator.parse_config(sys.argv[1:], DEFAULTS, __doc__)  # config files, --key=value; -h: list
globals().update(config)  # the constants as overridden, for the rest of the script

# -----------------------------------------------------------------------------
# the learning rate schedule: one function and the list of its schedules, checked before anything starts

def get_lr(it):
    """The learning rate of step it, a function of the step and the constants alone (a resumed run
    continues it): a linear warmup over warmup_steps, then lr_schedule: "cosine" decays to min_lr at
    max_steps (build-nanogpt's); "wsd" stays at max_lr, then decays over the last decay_frac of
    max_steps, "linear" or "1-sqrt" in shape (raising max_steps before the decay began moves it later)."""
    if it < warmup_steps:  # never exactly 0
        return max_lr * (it + 1) / warmup_steps
    if it >= max_steps:
        return min_lr
    if lr_schedule == 'cosine':
        ratio = (it - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)
    decay_steps = max(1, round(decay_frac * max_steps))
    progress = (it - (max_steps - decay_steps)) / decay_steps  # <= 0 in the stable phase, 1 at max_steps
    if progress <= 0:
        return max_lr
    return max_lr - (progress if decay_shape == 'linear' else math.sqrt(progress)) * (max_lr - min_lr)


if lr_schedule not in ('cosine', 'wsd'):  # get_lr's: a new schedule is a branch there and its name here
    raise UserError(f"config key 'lr_schedule' must be 'cosine' or 'wsd', got {lr_schedule!r}")

# -----------------------------------------------------------------------------
# DDP setup: torchrun starts one process per device and tells each who it is (RANK, LOCAL_RANK,
# WORLD_SIZE); plain `python` is a world of one. Every rank runs all of this script.
ddp = 'RANK' in os.environ
rank, local_rank, world_size = (int(os.environ.get(k, v)) for k, v in (('RANK', 0), ('LOCAL_RANK', 0),
                                                                         ('WORLD_SIZE', 1)))
master_process = rank == 0  # this process prints, logs and writes checkpoints
device = hardware.pick_device(device, local_rank if ddp else None)  # torchrun: cuda:LOCAL_RANK, a GPU each
cuda = device.startswith('cuda')
if cuda:
    torch.cuda.set_device(device)
    torch.set_float32_matmul_precision('high')  # TF32 for the float32 matmuls
if ddp:
    # NCCL between GPUs, gloo between CPU processes. A collective that waits past its timeout ends the
    # run (a stuck rank): an hour until the first step and the first evals are done, as each rank
    # compiles at its own pace, then collective_timeout (docs/ddp.md, 10). A torchrun restart meets on
    # keys of its own (restart_store)
    set_rank_environment(log_dir)  # NCCL's flight recorder into log_dir; the node's CPUs for compiling
    dist.init_process_group(backend='nccl' if cuda else 'gloo', store=restart_store(), rank=rank,
                            world_size=world_size, device_id=torch.device(device) if cuda else None,
                            timeout=first_step_timeout(collective_timeout))
config = hardware.choose_precision(config, device)  # dtype and compile "auto", the same on every rank
dtype, compile = config['dtype'], config['compile']
sharded = ddp and parallel == 'fsdp'  # FSDP: each rank holds a shard of the state (docs/fsdp.md)

# -----------------------------------------------------------------------------
# the model: resumed from log_dir's newest checkpoint (resume="auto": the same command continues a
# stopped run), fresh, or OpenAI's/HF's weights
shards.find_shards(data_root, 'train')  # a missing data folder is said before log_dir or a model is made
checkpoint.claim_log_dir(log_dir)  # one run per log_dir: rank 0 locks log_dir/run.lock
torch.manual_seed(seed)  # the same init on every rank (DDP also broadcasts rank 0's weights)
ckpt_path, ckpt = checkpoint.find_checkpoint(log_dir, resume)  # rank 0 validates it; the others follow
if ckpt is not None:  # the weights come from the checkpoint: nothing to download
    raw_model = GPT(checkpoint.resumed_model_config(ckpt, ckpt_path, config))
elif init_from == 'scratch':
    raw_model = GPT(GPTConfig.from_dict(config))
else:  # each node's first process downloads into its HF cache while the others wait, then they read it
    first = local_rank == 0
    try:
        if first:
            raw_model = GPT.from_pretrained(init_from)
        agree(0)  # however long the download takes (under the first step's timeout)
        if not first:
            raw_model = GPT.from_pretrained(init_from)
    except (ValueError, OSError) as e:  # not a GPT-2, a missing folder, no download
        raise UserError(f"init_from={init_from!r}: {e}") from None
    if master_process:
        print(f"init_from={init_from}: model shape from the weights: {raw_model.config}")
raw_model.dropout = dropout  # not the model's shape: a resume or init_from may set another
if T > raw_model.config.block_size:
    raise UserError(f"T={T} is longer than the model's block_size={raw_model.config.block_size}")
why_B = None
if B == 'auto':  # the most that fit this device's free memory, by count; every rank takes the least
    from gptkit import memory
    B, why_B = memory.micro_batch(config, raw_model.config, device, world_size)

# -----------------------------------------------------------------------------
# the data: every step reads total_batch_size tokens, B*T per micro-step per rank
grad_accum_steps = configurator.accumulation_steps(total_batch_size, B, T, world_size)  # total / (B*T*world)
vocab = raw_model.config.vocab_size
train_loader = DataLoaderLite(B, T, rank, world_size, 'train', data_root, grad_accum_steps, vocab, shuffle,
                              seed)
if eval_interval > 0:  # the first val_tokens of the val split, on the device once: (batches, B, T) each
    val_tokens_np = shards.load_val_tokens(data_root, val_tokens // T * T, vocab)
    val_x, val_y, val_text = (t.to(device) for t in shards.val_batches(val_tokens_np, B, T, rank, world_size))
    val_targets, val_bytes = len(val_tokens_np) - 1, max(1, tokenizer.utf8_bytes(val_tokens_np[1:]))

# -----------------------------------------------------------------------------
# to the device, the optimizer, compile and DDP
raw_model.to(device)  # never wrapped: its state_dict has no prefixes
if device == 'cpu':  # the CPU's own speed tricks (gptkit/cpu.py): a GPU never runs them
    cpu.fuse_loss(raw_model)  # the training loss in one pass over the logits
    if cpu_reuse_memory:
        cpu.reuse_freed_memory()  # freed memory kept for reuse: faster steps, more peak RSS
if sharded:
    from gptkit import fsdp
    fsdp.shard(raw_model)  # before the optimizer, which must see the shards
optimizer = raw_model.configure_optimizers(weight_decay, max_lr, hardware.device_type(device), optimizer,
                                           muon_lr, muon_momentum)
scaler = torch.amp.GradScaler(hardware.device_type(device), enabled=dtype == 'float16')  # float16 only
# updates done; the evals of `step` done; non-finite steps in a row; the bytes of log.txt and
# samples.txt that this run keeps (none when it starts afresh)
step, evaluated, bad_steps, logs = 0, False, 0, {}
if ckpt is not None:  # everything save_checkpoint (below) wrote, back in its place
    opt_state = dict(ckpt['optimizer'], param_groups=optimizer.state_dict()['param_groups'])  # our settings
    if sharded:
        fsdp.load_full_state(raw_model, optimizer, ckpt['model'], opt_state)  # each rank its shards
    else:
        raw_model.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(opt_state)
    for state in optimizer.state.values():  # on a CPU these would alias the checkpoint's memory map
        state.update({k: v.clone() for k, v in state.items() if torch.is_tensor(v) and v.is_cpu})
    if ckpt.get('scaler'):  # a float16 run's loss scale
        scaler.load_state_dict(ckpt['scaler'])
    train_loader.load_state(ckpt['loader'], ckpt_path)
    checkpoint.set_rng_state(ckpt['rng'], device)
    step, evaluated, bad_steps = ckpt['step'], ckpt['evaluated'], ckpt['bad_steps']
    logs = ckpt.get('logs')  # log_dir's logs as they were when it was written; None in older ones
    del ckpt  # the memory map
    if master_process:
        print(f"resuming from {ckpt_path}: step {step}, train data at {train_loader.state()['file']} "
              f"token {train_loader.pos:,}")
    if bad_steps >= max_bad_steps:  # not for an automatic restart to push on: a person decides
        raise UserError(f"{ckpt_path} was written after {bad_steps} steps in a row with a non-finite loss or "
                        f"gradient norm, and max_bad_steps={max_bad_steps}: to go on (after lowering max_lr, "
                        f"say), raise max_bad_steps above {bad_steps}, or point log_dir elsewhere to start "
                        f"afresh")
    if step > max_steps or (step == max_steps and evaluated):
        if master_process:
            print(f"nothing to do: {ckpt_path} is step {step} and max_steps={max_steps}; raise max_steps to "
                  f"train on, or point log_dir elsewhere to start afresh")
        sys.exit(0)
# static shapes: one graph. The evals run it without DDP: their batches differ per rank
model = eval_model = torch.compile(raw_model, dynamic=False) if compile else raw_model
if ddp and not sharded:
    for p in raw_model.parameters():  # DDP makes these its buckets' views: no second copy of the gradients
        p.grad = torch.zeros_like(p)
    model = DDP(model, device_ids=[local_rank] if cuda else None, gradient_as_bucket_view=True)
if hellaswag and eval_interval > 0:  # each rank's share of the examples, made once, on the device
    from gptkit import hellaswag as hellaswag_eval  # (hellaswag: the constant above)
    hella_data = hellaswag_eval.load_for_training(hellaswag_file, raw_model,
                                                  hellaswag_eval.examples_per_batch(B, T), device, compile)

# -----------------------------------------------------------------------------
# the run starts: what it is, in the output and in log_dir
flops_per_tok = flops_per_token(raw_model.config, T)
peak, peak_from = hardware.peak_flops(device, dtype)  # MFU: model FLOP/s over the peak of all devices
if master_process:
    print("config:\n" + "\n".join(f"  {k} = {v!r}" for k, v in config.items()))
    print(f"world_size={world_size} device={device} grad_accum_steps={grad_accum_steps}")
    if why_B:
        print(why_B)
    print(f"parameters: {sum(p.numel() for p in raw_model.parameters()):,}")
    print(f"train data: {train_loader.n_tokens:,} tokens, {train_loader.steps_per_epoch:,} steps per epoch "
          f"at {total_batch_size:,} tokens per step; max_steps={max_steps} is "
          f"{max_steps / train_loader.steps_per_epoch:.2f} epochs")
    print(f"mfu: against {peak / 1e12:.4g} TFLOP/s per process ({peak_from}), "
          f"{flops_per_tok / 1e6:.4g} MFLOP per token" if peak else f"mfu: {peak_from}")
    checkpoint.prepare_log_dir(log_dir, logs, step)  # lines after the checkpoint go
    if wandb_log:
        run_record.wandb_start(config, log_dir)
run_record.write(log_dir, dict(config, B=B, micro_batch=why_B), step, ckpt_path, device)


def save_checkpoint(val_loss):
    """log_dir/model_{step:05d}.pt: the state after `step` updates, everything a resume puts back (see
    the model's set-up above). Every rank calls it; rank 0 writes (gptkit/checkpoint.py: save)."""
    if sharded:  # the full state, gathered from the shards onto rank 0's host
        model_state, optimizer_state = fsdp.full_state(raw_model, optimizer)
    else:
        checkpoint.check_replicas(raw_model, step)  # DDP: a diverged replica is never saved
        model_state, optimizer_state = raw_model.state_dict(), optimizer.state_dict()
    checkpoint.save({'model': model_state, 'optimizer': optimizer_state, 'config': vars(raw_model.config),
                     'train_config': config, 'step': step, 'val_loss': val_loss, 'evaluated': evaluated,
                     'loader': train_loader.state(), 'rng': checkpoint.rng_state(device),
                     'bad_steps': bad_steps, 'scaler': scaler.state_dict(),  # logs: rank 0's files
                     'logs': checkpoint.log_sizes(log_dir) if master_process else {}},
                    log_dir, keep_checkpoints)


# -----------------------------------------------------------------------------
# the loop: at each step the model as it is is evaluated, sampled and checkpointed when due, then
# (unless it is the last step) updated: step -> step + 1
checkpoint.listen_for_stop_signals()  # from here SIGTERM and Ctrl-C only set a flag, read between steps
start_step = step
# collectives wait FIRST_STEP_TIMEOUT until every graph the run needs is built once: the first step's and
# the first evals' (a resumed run's come later)
evals_built = eval_interval == 0
for step in range(start_step, max_steps + 1):
    last_step = step == max_steps
    # SIGTERM or Ctrl-C on any rank sets a flag; the ranks agree on it here, at a step boundary, and all
    # stop with the checkpoint of this step, one line and exit code 75
    if agree(bool(checkpoint.stop_requested)):
        if not evaluated:  # else resumed from this step's checkpoint, which stands
            save_checkpoint(None)
        if master_process:
            print(f"{checkpoint.stop_requested or 'SIGTERM'}: stopped at step {step}; wrote "
                  f"{os.path.join(log_dir, f'model_{step:05d}.pt')}; run the same command again to resume "
                  f"(exit code {checkpoint.EXIT_PREEMPTED})")
        sys.exit(checkpoint.EXIT_PREEMPTED)
    if bad_steps >= max_bad_steps:  # the checkpoint holds the last good update's weights
        save_checkpoint(None)
        raise UserError(f"stopped after {bad_steps} steps in a row with a non-finite loss or gradient norm "
                        f"(max_bad_steps={max_bad_steps}); {os.path.join(log_dir, f'model_{step:05d}.pt')} "
                        f"holds the last good weights, with the data position after the skipped batches; "
                        f"lower max_lr or check the data, then raise max_bad_steps to resume from it")
    do_checkpoint = last_step or (checkpoint_interval > 0 and step > 0 and step % checkpoint_interval == 0)
    do_eval = eval_interval > 0 and (step % eval_interval == 0 or last_step or do_checkpoint)
    do_sample = sample_interval > 0 and step > 0 and (step % sample_interval == 0 or last_step)
    if not evaluated and (do_eval or do_sample or do_checkpoint):
        val_loss = None
        eval_raw = raw_model
        if sharded and (do_eval or do_sample):  # a plain copy of the whole weights, freed after the evals
            eval_model = eval_raw = fsdp.whole_model(raw_model, optimizer)
        if do_eval:  # the val loss and its bits per byte, each rank its sequences, summed over all ranks
            eval_model.eval()
            with torch.no_grad():
                sums = torch.zeros(2, device=device)  # the loss summed over all targets, and over text's
                for x, y, text in zip(val_x, val_y, val_text):
                    with hardware.autocast(device, dtype):
                        _, losses = eval_model(x, y, reduction='none')  # (B, T), 0 where y is -1
                    sums += torch.stack((losses.sum(), (losses * text).sum())).float()
            if ddp:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # gloo has no AVG
            loss_sum, text_loss = sums.tolist()  # the host's one read of this eval
            # bits per byte, as nanochat's: the loss in bits of the targets that decode to text, per byte
            val_loss, bpb = loss_sum / val_targets, text_loss / math.log(2) / val_bytes
            if master_process:
                print(f"step {step:5d} | val loss {val_loss:.4f} | val bpb {bpb:.4f}")
                run_record.log(log_dir, f"{step} val {val_loss:.4f}")
                run_record.log(log_dir, f"{step} bpb {bpb:.4f}")
        if do_eval and hellaswag:  # the plain model, in its own compiled graph, under DDP too
            counts = hellaswag_eval.evaluate(eval_raw, hella_data, dtype, compile)  # examples, acc, acc_norm
            if ddp:
                dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # each rank scored its share of the examples
            n, correct, correct_norm = counts.tolist()
            if master_process:
                print(f"step {step:5d} | hellaswag acc_norm {correct_norm}/{n} = {correct_norm / n:.4f} "
                      f"(acc {correct / n:.4f})")
                run_record.log(log_dir, f"{step} hella {correct_norm / n:.4f}")
        enc = tokenizer.get_gpt2_encoding()
        if do_sample and master_process and vocab < enc.n_vocab:  # no text to show: say so
            print(f"step {step}: no samples: the model's vocab_size={vocab} is smaller than GPT-2's "
                  f"{enc.n_vocab}: its tokens are not GPT-2's")
        if do_sample and master_process and vocab >= enc.n_vocab:  # 4 continuations of sample_prompt
            prompt = enc.encode(sample_prompt)[-raw_model.config.block_size:] or [enc.eot_token]
            tokens = torch.tensor([prompt] * 4, dtype=torch.long, device=device)
            rng = torch.Generator(device=device).manual_seed(42 + step)  # a resumed run writes the same ones
            eval_raw.eval()
            with hardware.autocast(device, dtype):
                out = eval_raw.generate(tokens, sample_length, top_k=50, generator=rng)
            texts = [enc.decode([t for t in row if t < enc.n_vocab]) for row in out.tolist()]
            run_record.samples(log_dir, [f"step {step} sample {i}: {text!r}" for i, text in enumerate(texts)])
        if sharded:
            eval_model = eval_raw = None  # the gathered copy goes
        evaluated, evals_built = True, evals_built or do_eval
        if do_checkpoint:
            save_checkpoint(val_loss)
    if last_step:
        break

    # one optimizer step over grad_accum_steps micro-batches of B sequences
    if master_process and train_loader.epoch_begins():
        order = 'a new order' if shuffle else 'in order'
        print(f"step {step:5d} | epoch {train_loader.epoch} begins ({order})")
        run_record.log(log_dir, f"{step} epoch {train_loader.epoch}")
    t0 = time.time()
    model.train()
    optimizer.zero_grad(set_to_none=not isinstance(model, DDP))  # DDP: zeroed in place, in its buckets
    loss_accum = torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        x, y = train_loader.next_batch()
        if cuda:  # from pinned memory the copy runs without the host waiting for it
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # The gradients are synchronised (DDP all-reduces them, FSDP reduce-scatters) in the backward of
        # the last micro-step only. As nanoGPT does, the flag that no_sync() would set is set here directly.
        if isinstance(model, DDP):
            model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
        if sharded:
            raw_model.set_requires_gradient_sync(micro_step == grad_accum_steps - 1)
        # dropout's masks: from the seed, the step and each sequence's place in the step, whatever the ranks
        # and micro-steps (model.py: GPT.drop)
        keys = (torch.arange(B, device=device) + (micro_step * world_size + rank) * B
                + ((seed * 1_000_003 + step) % 2 ** 31 << 32)) if dropout > 0 else None
        with hardware.autocast(device, dtype):
            _, loss = model(x, y, dropout_keys=keys)
        loss = loss / grad_accum_steps  # the gradient of the mean over all micro-batches
        loss_accum += loss.detach()
        scaler.scale(loss).backward()  # float16: the loss scaled up so that small gradients survive
    if ddp:
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)  # the loss we print: the mean over all ranks
        loss_accum /= world_size
    scaler.unscale_(optimizer)  # float16: the gradients back to their true size, before clipping
    norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    if sharded:
        norm = norm.full_tensor()  # the norm of the whole gradient, from every rank's shards
    lr = get_lr(step)
    for group in optimizer.param_groups:
        group['lr'] = lr * group.get('lr_scale', 1.0)  # muon: its groups' lr is muon_lr / max_lr times lr
    # A non-finite loss or norm (the same on every rank) skips the update on the device, with no host
    # read before it is queued: fused AdamW and Muon (gptkit/optim.py) read found_inf, as GradScaler's.
    finite = torch.stack((torch.isfinite(loss_accum), torch.isfinite(norm)))
    optimizer.found_inf = (~finite.all()).float()
    optimizer.step()
    finite_loss, finite_norm = finite.tolist()  # the step's first wait, once its update is queued
    scale = scaler.get_scale() if finite_loss and not finite_norm else 0  # read only then: a GPU waits
    scaler.update()  # float16: halve the scale after an inf/nan gradient, double it after 2000 clean steps
    overflow = scale > 1 and scaler.get_scale() < scale  # float16 at work: neither a good step nor a bad one
    if finite_loss and finite_norm:
        bad_steps = 0
    elif not overflow:
        bad_steps += 1
    loss = loss_accum.item()  # waits for the step to finish: dt is its real time
    dt = time.time() - t0
    if evals_built:  # every rank has compiled, each at its pace: from here a stuck rank ends the run soon
        set_collective_timeout(collective_timeout)  # (the first call does it: docs/ddp.md, 10)
    if step == start_step:
        t_first = time.time()  # the first step compiles: the ETA counts from its end
        if master_process and sharded:  # what a rank holds: its shards (DDP: whole tensors on every rank)
            mib = fsdp.state_mib(raw_model, optimizer)
            print(f"parameters, gradients and optimizer state per rank: {mib:.1f} MiB")
    evaluated = False
    if master_process:
        step_time = dt if step == start_step else (time.time() - t_first) / (step - start_step)
        eta = round(step_time * (max_steps - step - 1))  # seconds: the steps left at the mean time so far
        mfu = f"mfu {total_batch_size / dt * flops_per_tok / (peak * world_size):.1%} | " if peak else ""
        line = (f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm.item():.4f} | "
                f"dt {dt * 1000:.2f}ms | tok/sec {total_batch_size / dt:.2f} | {mfu}"
                f"eta {eta // 3600}h{eta % 3600 // 60:02d}m{eta % 60:02d}s")
        run_record.log(log_dir, f"{step} train {loss:.6f}")
        if overflow:
            line += f" | float16 overflow: update skipped, loss scale now {scaler.get_scale():g}"
            run_record.log(log_dir, f"{step} overflow {scaler.get_scale():g}")
        elif bad_steps:
            line += f" | non-finite: update skipped ({bad_steps} in a row, max_bad_steps={max_bad_steps})"
            run_record.log(log_dir, f"{step} skip {bad_steps}")
        print(line)

"""
Train GPT-2 on FineWeb-Edu token shards, on one CPU/GPU or many GPUs.

    python train_gpt2.py                                   # one process: cuda, mps or cpu
    torchrun --standalone --nproc_per_node=8 train_gpt2.py # one node, 8 GPUs (DDP over NCCL)
    python train_gpt2.py config/NAME.py --max_steps=100 --dtype=float32

One run, top to bottom, as nanoGPT's train.py: the constants (override them with config
files and --key=value), DDP setup, the model, the data, the optimizer, then the loop. How a
run starts, resumes and ends is gptkit/run.py's Run; docs/ddp.md tells the DDP parts.
"""
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gptkit import checkpoint, configurator, cpu, distributed, hardware, hellaswag_eval, shards
from gptkit import tokenizer
from gptkit.common import UserError, cpu_cores
from gptkit.run import Run
from gptkit.shards import DataLoaderLite
from model import GPT, GPTConfig, flops_per_token

# -----------------------------------------------------------------------------
# config: the defaults reproduce GPT-2 124M on 10B tokens of FineWeb-Edu (build-nanogpt's run)
# I/O
data_root = "edu_fineweb10B"  # folder of uint16 token shards (fineweb.py)
shuffle = True  # a fresh order of shards and documents each epoch (False: in order)
log_dir = "log"  # log.txt, samples.txt and checkpoints go here
init_from = "scratch"  # or an OpenAI name (gpt2, ...) or a HF model folder
# model (when init_from is not "scratch", the weights bring their own shape)
n_layer = 12  # transformer blocks
n_head = 12  # attention heads per block
n_embd = 768  # width: the size of each token's vector
block_size = 1024  # longest sequence the model can see
vocab_size = 50304  # GPT-2's vocabulary padded to a multiple of 128: faster matmuls
# batch: total_batch_size tokens per step = B * T * world_size * grad_accum_steps
total_batch_size = 524288  # 2**19, ~0.5M tokens, as GPT-3 124M
B = 64  # micro-batch per process: 64 fits 124M in 80 GB; or "auto"
T = 1024  # sequence length
# optimizer: warmup, then cosine decay to min_lr (recipes: docs/recipes.md)
max_lr = 6e-4  # the peak, at the end of warmup
min_lr = 6e-5  # where the decay ends: max_lr / 10
warmup_steps = 715  # 375M tokens, as GPT-3
max_steps = 19073  # 10B tokens / 2**19 per step: about one epoch of sample-10BT
weight_decay = 0.1  # AdamW's, on the 2-D weights only
grad_clip = 1.0  # clip the global gradient norm to this; 0 disables
lr_schedule = "cosine"  # or "wsd": warmup, max_lr, then decay_shape to min_lr
decay_frac = 0.2  # wsd: the last 20% of max_steps decay
decay_shape = "linear"  # wsd: "linear" or "1-sqrt"
optimizer = "adamw"  # or "muon": Muon for the blocks' matrices, AdamW for the rest
muon_lr = 1.8e-3  # muon: its peak lr (docs/recipes.md), scheduled alike
muon_momentum = 0.95  # muon: Nesterov momentum
dropout = 0.0  # for finetuning (GPT-2 pretrained with none)
# evaluation, samples, checkpoints: every N steps and at the last step (0: off)
eval_interval = 250  # val loss, bits per byte and HellaSwag
val_tokens = 10485760  # the first 10M tokens of the val split, for any world size
sample_interval = 250  # 4 continuations of sample_prompt into samples.txt
sample_prompt = "Hello, I'm a language model,"  # what the samples continue
sample_length = 32  # new tokens in each sample
checkpoint_interval = 1000  # 0: only at the last step (and on SIGTERM)
keep_checkpoints = 3  # older checkpoints are deleted; 0 keeps all
resume = "auto"  # continue from the newest valid checkpoint in log_dir; "never"
max_bad_steps = 5  # non-finite loss or norm: skip; stop after this many in a row
hellaswag = True  # HellaSwag acc_norm at every eval, all ranks sharing the work
hellaswag_file = ""  # a HellaSwag jsonl file; "": the val split, downloaded once
# system
device = "auto"  # auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps
dtype = "auto"  # auto (the hardware's fast one), bfloat16, float16, float32
compile = "auto"  # torch.compile: "auto" = on CUDA; True, False
cpu_reuse_memory = True  # CPU on Linux: faster steps, more peak RSS
parallel = "ddp"  # under torchrun: "ddp", or "fsdp" (sharded: docs/fsdp.md)
bucket_cap_mb = 25  # DDP: MiB of gradients per all-reduce; compiled, about a graph piece each
collective_timeout = 600  # seconds a rank waits for the others after the first step
seed = 1337  # the init, the data's order, the samples
# Weights & Biases, rank 0 (pip install -r requirements-wandb.txt)
wandb_log = False  # also log to W&B
wandb_project = "gpt2"  # the W&B project
wandb_run_name = "gpt2-124M"  # the W&B run's name
DEFAULTS = {k: v for k, v in globals().items() if k[0] != '_' and type(v) in (bool, int, float, str)}
# From here an error ends the run in one line (sys.excepthook); at exit
# the lock on log_dir and the process group are released (atexit)
run = Run()
# config files and --key=value, in the order given; -h lists the constants
config = configurator.parse_config(sys.argv[1:], DEFAULTS, __doc__)
globals().update(config)
# the schedules get_lr knows
if lr_schedule not in ('cosine', 'wsd'):
    raise UserError(f"config key 'lr_schedule' must be 'cosine' or 'wsd', got {lr_schedule!r}")


def get_lr(it):
    """A linear warmup, then lr_schedule: "cosine" decays to min_lr at max_steps;
    "wsd" stays at max_lr, then decays over the last decay_frac of max_steps."""
    if it < warmup_steps:
        return max_lr * (it + 1) / warmup_steps
    if it >= max_steps:
        return min_lr
    if lr_schedule == 'cosine':
        ratio = (it - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)
    decay_steps = max(1, round(decay_frac * max_steps))
    # <= 0 before the decay, 1 at max_steps
    progress = (it - (max_steps - decay_steps)) / decay_steps
    if progress <= 0:
        return max_lr
    drop = progress if decay_shape == 'linear' else math.sqrt(progress)
    return max_lr - drop * (max_lr - min_lr)


# -----------------------------------------------------------------------------
# DDP setup: torchrun starts one process per device and tells each who it is;
# plain `python` is a world of one. Every rank runs all of this script.
ddp = 'RANK' in os.environ
rank = int(os.environ.get('RANK', 0))
local_rank = int(os.environ.get('LOCAL_RANK', 0))
world_size = int(os.environ.get('WORLD_SIZE', 1))
# this process prints, logs and writes checkpoints
master_process = rank == 0
# torchrun: cuda:LOCAL_RANK, one GPU per process
dev = hardware.pick_device(device, local_rank if ddp else None)
cuda = dev.startswith('cuda')
if cuda:
    torch.cuda.set_device(dev)
    # TF32 for the float32 matmuls
    torch.set_float32_matmul_precision('high')
if ddp:
    # NCCL between GPUs, gloo between CPUs. A collective that waits too long
    # ends the run: an hour until the first step and evals are done (each
    # rank compiles at its own pace), then collective_timeout. A torchrun
    # restart meets on keys of its own (restart_store).
    distributed.set_rank_environment(log_dir)
    timeout = run.first_step_timeout(collective_timeout, evals=eval_interval > 0)
    backend = 'nccl' if cuda else 'gloo'
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            store=distributed.restart_store(), timeout=timeout,
                            device_id=torch.device(dev) if cuda else None)
# dtype and compile "auto" made concrete, the same on every rank
config = hardware.choose_precision(config, dev)
amp_dtype, use_compile = config['dtype'], config['compile']
# FSDP: each rank holds a shard of the state (docs/fsdp.md)
sharded = ddp and parallel == 'fsdp'

# -----------------------------------------------------------------------------
# the model: from log_dir's newest checkpoint (the same command continues a
# stopped run), fresh, or OpenAI's/HF's weights. Missing data is said first;
# then rank 0 locks log_dir (one run per log_dir) and picks the checkpoint.
shards.find_shards(data_root, 'train')
ckpt = run.start(config, dev)
# the same init on every rank
torch.manual_seed(seed)
if ckpt is not None:
    raw_model = GPT(checkpoint.resumed_model_config(ckpt, run.checkpoint_path, config))
elif init_from == 'scratch':
    raw_model = GPT(GPTConfig.from_dict(config))
else:
    # each node's first process downloads into its HF cache while the others wait
    try:
        if local_rank == 0:
            raw_model = GPT.from_pretrained(init_from)
        distributed.barrier()
        if local_rank != 0:
            raw_model = GPT.from_pretrained(init_from)
    except (ValueError, OSError) as e:
        raise UserError(f"init_from={init_from!r}: {e}") from None
    if master_process:
        print(f"init_from={init_from}: model shape from the weights: {raw_model.config}")
# dropout is a setting, not the shape: a checkpoint or init_from may hold another
raw_model.dropout = dropout
if T > raw_model.config.block_size:
    raise UserError(f"T={T} is longer than the model's block_size={raw_model.config.block_size}")
# B="auto": the most that fit this device's free memory; every rank takes the least
micro_B, why_B, counted = B, None, None
if B == 'auto':
    from gptkit import memory
    micro_B, why_B, counted = memory.micro_batch(config, raw_model.config, dev, world_size)
# what an out-of-memory error's line says
run.memory = micro_B, counted

# -----------------------------------------------------------------------------
# the data: total_batch_size tokens a step, micro_B * T per micro-step per rank
grad_accum_steps = configurator.accumulation_steps(total_batch_size, micro_B, T, world_size)
vocab = raw_model.config.vocab_size
train_loader = DataLoaderLite(micro_B, T, rank, world_size, 'train', data_root, grad_accum_steps,
                              vocab, shuffle, seed)
if eval_interval > 0:
    # the first val_tokens of the val split: this rank's batches, on the device
    val_np = shards.load_val_tokens(data_root, val_tokens // T * T, vocab)
    val_batches = shards.val_batches(val_np, micro_B, T, rank, world_size)
    val_x, val_y, val_text = (t.to(dev) for t in val_batches)
    val_targets = len(val_np) - 1
    val_bytes = max(1, tokenizer.utf8_bytes(val_np[1:]))

# -----------------------------------------------------------------------------
# to the device, the optimizer, compile and DDP. raw_model is never wrapped:
# its state_dict has no prefixes
raw_model.to(dev)
# the CPU's own speed tricks (gptkit/cpu.py): a GPU never runs them
if dev == 'cpu':
    cpu.speed_up(raw_model, cpu_reuse_memory)
# FSDP shards the model before the optimizer, which must see the shards
if sharded:
    from gptkit import fsdp
    fsdp.shard(raw_model)
device_type = hardware.device_type(dev)
opt = raw_model.configure_optimizers(weight_decay, max_lr, device_type, optimizer,
                                     muon_lr, muon_momentum)
# float16 only: the loss scaled up so that small gradients survive
scaler = torch.amp.GradScaler(device_type, enabled=amp_dtype == 'float16')
# What a checkpoint holds besides the run's counters: each entry is saved by
# its state_dict() and resumed by its load_state_dict(). New state (an EMA of
# the weights, say) is one more entry.
state = {'model': raw_model, 'optimizer': opt, 'scaler': scaler, 'loader': train_loader}
# (FSDP: whole tensors gathered from the shards, in DDP's format)
if sharded:
    state.update(fsdp.checkpoint_entries(raw_model, opt))
# each entry back as the checkpoint holds it (a finished run exits here)
start_step = run.resume(ckpt, state)
del ckpt
# static shapes: one graph. The evals run it without DDP (each rank its own
# batches)
eval_model = torch.compile(raw_model, dynamic=False) if use_compile else raw_model
model = eval_model
if ddp and not sharded:
    # DDP makes these its buckets' views: no second copy of the gradients
    for p in raw_model.parameters():
        p.grad = torch.zeros_like(p)
    model = DDP(eval_model, device_ids=[local_rank] if cuda else None,
                gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb)
if hellaswag and eval_interval > 0:
    # this rank's share of the examples, on the device once
    hella_data = hellaswag_eval.load_for_training(hellaswag_file, raw_model, micro_B, T, dev,
                                                  use_compile)

# -----------------------------------------------------------------------------
# the run starts: what it is, in the output and in log_dir
flops_per_tok = flops_per_token(raw_model.config, T)
# MFU: the model's FLOP/s over the peak of all devices
peak, peak_from = hardware.peak_flops(dev, amp_dtype)
if master_process:
    # what differs from the constants above: run.json holds them all
    changed = [f"  {k} = {v!r}" for k, v in config.items() if v != DEFAULTS.get(k)]
    print("config, where it differs from the defaults (run.json holds it all):\n" + "\n".join(changed))
    if eval_interval > 0 and checkpoint_interval % eval_interval:
        print(f"note: a checkpoint step evaluates too (a checkpoint holds its own val loss): every "
              f"checkpoint_interval={checkpoint_interval} steps, besides eval_interval={eval_interval}")
    print(f"world_size={world_size} device={dev} grad_accum_steps={grad_accum_steps}")
    # CPU processes beyond the cores take turns, and every step waits for the last
    node_procs, cores = int(os.environ.get('LOCAL_WORLD_SIZE', 1)), cpu_cores()
    if dev == 'cpu' and node_procs > cores:
        print(f"warning: {node_procs} processes on {cores} CPU cores: they take turns, each step as slow "
              f"as the last of them; --nproc_per_node={cores} is faster")
    if why_B:
        print(why_B)
    print(f"parameters: {sum(p.numel() for p in raw_model.parameters()):,}")
    epochs = max_steps / train_loader.steps_per_epoch
    print(f"train data: {train_loader.n_tokens:,} tokens, "
          f"{train_loader.steps_per_epoch:,} steps per epoch at {total_batch_size:,} "
          f"tokens per step; max_steps={max_steps} is {epochs:.2f} epochs")
    if peak:
        print(f"mfu: against {peak / 1e12:.4g} TFLOP/s per process ({peak_from}), "
              f"{flops_per_tok / 1e6:.4g} MFLOP per token")
    else:
        print(f"mfu: {peak_from}")
# rank 0 cuts the logs back to the checkpoint's lines; every rank adds to run.json
run.begin(dict(config, B=micro_B, micro_batch=why_B), start_step)


def save_checkpoint(val_loss):
    """log_dir/model_{step:05d}.pt: the state after `step` updates (every rank)."""
    extra = {'config': vars(raw_model.config), 'train_config': config, 'val_loss': val_loss}
    run.save(step, state, extra)


# -----------------------------------------------------------------------------
# the loop: each step is evaluated, sampled and checkpointed when due, then
# (unless it is the last) updated: step -> step + 1
# From here SIGTERM and Ctrl-C set a flag, which the next step's all-reduce
# carries to every rank (signal handlers)
run.listen_for_stop_signals()
# dt: the wall time from the end of one step to the end of the next, as
# nanoGPT's, less the evals, samples and checkpoints (timed apart)
t_last = time.time()
for step in range(start_step, max_steps + 1):
    last_step = step == max_steps
    # a stop signal on any rank, or too many bad steps in a row: every rank
    # stops here, with this step's checkpoint (exit code 75 after a signal)
    if run.must_stop():
        if not run.evaluated:
            save_checkpoint(None)
        run.stop(step)
    do_checkpoint = last_step or (checkpoint_interval > 0 and step > 0 and step % checkpoint_interval == 0)
    do_eval = eval_interval > 0 and (step % eval_interval == 0 or last_step or do_checkpoint)
    do_sample = sample_interval > 0 and step > 0 and (step % sample_interval == 0 or last_step)
    if not run.evaluated and (do_eval or do_sample or do_checkpoint):
        t_evals = time.time()
        val_loss = None
        # FSDP: the evals run on a whole copy of the weights, freed after them
        if sharded and (do_eval or do_sample):
            eval_model = fsdp.whole_model(raw_model, opt)
        if do_eval:
            # the val loss and its bits per byte, summed over all ranks
            eval_model.eval()
            # the loss summed over all targets, and over those that decode to text
            sums = torch.zeros(2, device=dev)
            with torch.no_grad():
                for x, y, text in zip(val_x, val_y, val_text):
                    # each target's loss (B, T), 0 where y is -1 (padding)
                    with hardware.autocast(dev, amp_dtype):
                        _, losses = eval_model(x, y, reduction='none')
                    sums += torch.stack((losses.sum(), (losses * text).sum())).float()
            if ddp:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            loss_sum, text_loss = sums.tolist()
            val_loss = loss_sum / val_targets
            # bits per byte, as nanochat's: the text targets' loss in bits
            bpb = text_loss / math.log(2) / val_bytes
            if master_process:
                print(f"step {step:5d} | val loss {val_loss:.4f} | val bpb {bpb:.4f}")
                run.log(f"{step} val {val_loss:.4f}")
                run.log(f"{step} bpb {bpb:.4f}")
        if do_eval and hellaswag:
            # examples, correct by acc and by acc_norm, summed over all ranks
            counts = hellaswag_eval.evaluate(eval_model, hella_data, amp_dtype, use_compile)
            if ddp:
                dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            n, correct, correct_norm = counts.tolist()
            if master_process:
                print(f"step {step:5d} | hellaswag acc_norm {correct_norm}/{n} = "
                      f"{correct_norm / n:.4f} (acc {correct / n:.4f})")
                run.log(f"{step} hella {correct_norm / n:.4f}")
        enc = tokenizer.get_gpt2_encoding()
        if do_sample and master_process and vocab < enc.n_vocab:
            print(f"step {step}: no samples: the model's vocab_size={vocab} is smaller than "
                  f"GPT-2's {enc.n_vocab}: its tokens are not GPT-2's")
        elif do_sample and master_process:
            # 4 continuations of sample_prompt; a resumed run writes the same ones
            prompt = enc.encode(sample_prompt)[-raw_model.config.block_size:] or [enc.eot_token]
            tokens = torch.tensor([prompt] * 4, dtype=torch.long, device=dev)
            rng = torch.Generator(device=dev).manual_seed(42 + step)
            eval_model.eval()
            with hardware.autocast(dev, amp_dtype):
                out = eval_model.generate(tokens, sample_length, top_k=50, generator=rng)
            texts = [enc.decode([t for t in row if t < enc.n_vocab]) for row in out.tolist()]
            run.samples([f"step {step} sample {i}: {text!r}" for i, text in enumerate(texts)])
        # FSDP: the gathered copy goes
        if sharded:
            eval_model = None
        run.evals_done(do_eval)
        if do_checkpoint:
            save_checkpoint(val_loss)
        if master_process:
            done = [name for name, due in (('evals', do_eval), ('samples', do_sample),
                                           ('checkpoint copy', do_checkpoint)) if due]
            print(f"step {step:5d} | {', '.join(done)}: {time.time() - t_evals:.2f}s, not in dt")
        t_last += time.time() - t_evals
    if last_step:
        break

    # one optimizer step over grad_accum_steps micro-batches
    if master_process and train_loader.epoch_begins():
        order = 'a new order' if shuffle else 'in order'
        print(f"step {step:5d} | epoch {train_loader.epoch} begins ({order})")
        run.log(f"{step} epoch {train_loader.epoch}")
    model.train()
    # DDP: the gradients are zeroed in place, in its buckets
    opt.zero_grad(set_to_none=not isinstance(model, DDP))
    loss_accum = torch.zeros((), device=dev)
    for micro_step in range(grad_accum_steps):
        x, y = train_loader.next_batch()
        # from pinned memory the copy runs without the host waiting for it
        if cuda:
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        # The gradients are synchronised (DDP all-reduces them, FSDP
        # reduce-scatters) in the backward of the last micro-step only. As
        # nanoGPT does, we set the flag that no_sync() would set directly.
        sync = micro_step == grad_accum_steps - 1
        if isinstance(model, DDP):
            model.require_backward_grad_sync = sync
        if sharded:
            raw_model.set_requires_gradient_sync(sync)
        # dropout's masks: from the seed, the step and each sequence's place in
        # the step, for any number of ranks and micro-steps (model.py: GPT.drop)
        keys = None
        if dropout > 0:
            first = (micro_step * world_size + rank) * micro_B
            step_key = (seed * 1_000_003 + step) % 2 ** 31 << 32
            keys = torch.arange(micro_B, device=dev) + first + step_key
        with hardware.autocast(dev, amp_dtype):
            _, loss = model(x, y, dropout_keys=keys)
        # the gradient of the mean over all micro-batches
        loss = loss / grad_accum_steps
        loss_accum += loss.detach()
        scaler.scale(loss).backward()
    # the step's one all-reduce of its own: the loss we print (the mean over
    # all ranks), a stop signal on any rank and a failed write on rank 0
    stop, failed = run.flags()
    reduced = torch.stack((loss_accum, torch.full_like(loss_accum, stop),
                           torch.full_like(loss_accum, failed)))
    if ddp:
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    loss_accum = reduced[0] / world_size
    # float16: the gradients back to their true size, before clipping
    scaler.unscale_(opt)
    clip = grad_clip if grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
    # FSDP: the norm of the whole gradient, from every rank's shards
    if sharded:
        norm = norm.full_tensor()
    lr = get_lr(step)
    for group in opt.param_groups:
        # muon: its groups' lr is muon_lr / max_lr times lr
        group['lr'] = lr * group.get('lr_scale', 1.0)
    # A non-finite loss or norm (the same on every rank) skips the update on
    # the device, with no host read before it is queued: fused AdamW and Muon
    # read found_inf, as GradScaler's do.
    stats = torch.stack((loss_accum, norm, *reduced[1:]))
    opt.found_inf = (~torch.isfinite(stats[:2]).all()).float()
    opt.step()
    # the step's one host read, once its update is queued: it waits for the
    # step to finish, so dt is its real time
    loss, norm, stops, failures = stats.tolist()
    t_end = time.time()
    dt, t_last = t_end - t_last, t_end
    finite_loss, finite_norm = math.isfinite(loss), math.isfinite(norm)
    # float16: a gradient that overflowed where GradScaler saw it (a loss scale
    # too high, which it lowers) is skipped, but is not a bad step
    scale = scaler.get_scale() if finite_loss and not finite_norm else 0
    scaler.update()
    overflow = scale > 1 and scaler.get_scale() < scale
    run.end_step(good=finite_loss and finite_norm, overflow=overflow, stop=stops > 0, failed=failures > 0)
    # the first step compiles: the ETA counts from its end
    if step == start_step:
        t_first = time.time()
        if master_process and sharded:
            mib = fsdp.state_mib(raw_model, opt)
            print(f"parameters, gradients and optimizer state per rank: {mib:.1f} MiB")
        if master_process and use_compile and isinstance(model, DDP) and (pieces := hardware.graph_pieces()):
            print(f"compiled under DDP: the training graph in {pieces} piece{'s' * (pieces > 1)}, about "
                  f"one per bucket_cap_mb={bucket_cap_mb} MiB of gradients (docs/ddp.md)")
        if master_process:
            run.say_checkpoint_cost(checkpoint.state_bytes(raw_model, opt, pinned=cuda and not sharded))
    if master_process:
        # the mean time of a step so far, and the time the steps left take at it
        step_time = dt if step == start_step else (time.time() - t_first) / (step - start_step)
        eta = round(step_time * (max_steps - step - 1))
        tok_per_sec = total_batch_size / dt
        mfu = f"mfu {tok_per_sec * flops_per_tok / (peak * world_size):.1%} | " if peak else ""
        line = (f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f} | "
                f"dt {dt * 1000:.2f}ms | tok/sec {tok_per_sec:.2f} | {mfu}"
                f"eta {eta // 3600}h{eta % 3600 // 60:02d}m{eta % 60:02d}s")
        run.log(f"{step} train {loss:.6f}")
        if overflow:
            line += f" | float16 overflow: update skipped, loss scale now {scaler.get_scale():g}"
            run.log(f"{step} overflow {scaler.get_scale():g}")
        elif run.bad_steps:
            line += (f" | non-finite: update skipped ({run.bad_steps} in a row, "
                     f"max_bad_steps={max_bad_steps})")
            run.log(f"{step} skip {run.bad_steps}")
        print(line)
# the last checkpoint on disk before the run ends (rank 0's writes; every rank learns how they went)
run.end()

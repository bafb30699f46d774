"""
Train GPT-2 on FineWeb-Edu token shards, on one CPU/GPU or many GPUs.

    python train_gpt2.py                                   # one process: cuda, mps or cpu
    torchrun --standalone --nproc_per_node=8 train_gpt2.py # one node, 8 GPUs (DDP over NCCL)
    python train_gpt2.py config/NAME.py --max_steps=100 --dtype=float32

One run, top to bottom: the constants (edit them here, or override them with config files and
--key=value arguments); DDP setup from torchrun's environment; the data; the evaluations; one
training step with gradient accumulation; the loop that evaluates, samples, checkpoints and stops.
The run's functions read the constants; what other files import takes what it needs as arguments.
The machinery lives in gptkit/: the other collectives in parallel.py, checkpoints and SIGTERM
(exit 75) in checkpoint.py, log.txt and run.json in run_record.py. The DDP parts: docs/ddp.md.
"""
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from gptkit import checkpoint, memory, run_record
from gptkit.checkpoint import TrainState
from gptkit.common import UserError
from gptkit.configurator import accumulation_steps, parse_config
from gptkit.cpu import reuse_freed_memory
from gptkit.hardware import autocast, choose_precision, peak_flops, pick_device, pinned
from gptkit.optim import get_lr
from gptkit.parallel import (agree, clip_grad_norm, end_process_group, first_on_node, first_step_timeout,
                             gave_up, hold_to, require_backward_grad_sync, restart_store, shard_fsdp,
                             state_mib, wait_for_all, whole_models, world_size, wrap_ddp, zero_grad)
from gptkit.parallel import rank as process_rank
from gptkit.shards import ShardStream, find_shards, load_val_tokens
from gptkit.tokenizer import token_byte_lengths, utf8_bytes
from model import GPT, GPTConfig, flops_per_token
from sample import training_samples

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
B = "auto"  # micro-batch: sequences per forward/backward per process; "auto": the most that fit
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


# -----------------------------------------------------------------------------
# DDP setup: torchrun starts one process per device and tells each who it is (RANK, LOCAL_RANK,
# WORLD_SIZE); plain `python` is a world of one. Every rank runs all of this script.

rank, world = 0, 1  # this process among all, set by main() from torchrun's environment
config = DEFAULTS  # set by main(): the constants as run, recorded in run.json and the checkpoints
phase = 'the setup'  # what the run is doing: the line that ends a run stuck or out of memory names it


def setup_device(device, cpu_reuse_memory=False, collective_timeout=DEFAULTS['collective_timeout']):
    """(rank, world_size, device): torchrun's RANK means DDP, one process per device."""
    ddp = 'RANK' in os.environ
    rank, local_rank, world = 0, 0, 1
    if ddp:
        rank, local_rank, world = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
    device = pick_device(device, local_rank if ddp else None)  # torchrun: cuda:LOCAL_RANK, a GPU each
    cuda = device.startswith('cuda')
    if cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision('high')  # TF32 for the float32 matmuls
    if device == 'cpu' and cpu_reuse_memory:
        reuse_freed_memory()  # the CPU's own speed trick: gptkit/cpu.py
    if ddp:
        # NCCL between GPUs, gloo between CPU processes. A collective that waits longer than its timeout
        # ends the run (a stuck rank): an hour until the first step is done, as each rank compiles at its
        # own pace, then collective_timeout (train: hold_to); rank 0's long work alone: wait_for_all
        dist.init_process_group(backend='nccl' if cuda else 'gloo', store=restart_store(), rank=rank,
                                world_size=world, device_id=torch.device(device) if cuda else None,
                                timeout=first_step_timeout(collective_timeout))
    return rank, world, device


# -----------------------------------------------------------------------------
# data: the uint16 token shards of fineweb.py (and build-nanogpt's), memory-mapped

class DataLoaderLite(ShardStream):
    """Batches of B sequences of T tokens from the shards of one split, read as one stream whose
    position moves by whole steps, the same on every rank (gptkit/shards.py: ShardStream, with the
    shuffled order and resuming). A step reads one run of B*T*num_processes*accum_steps (+1)
    tokens; micro-step m of rank r takes its chunk m * num_processes + r: the tokens of a step do
    not depend on the number of processes."""

    def __init__(self, B, T, process_rank, num_processes, split, data_root, accum_steps=1,
                 vocab_size=None, shuffle=False, seed=1337):
        self.B, self.T, self.rank, self.world, self.accum = B, T, process_rank, num_processes, accum_steps
        self.micro = 0  # the micro-steps of this step read so far
        step_tokens = B * T * num_processes * accum_steps
        super().__init__(data_root, split, step_tokens, vocab_size, shuffle, seed, say=process_rank == 0)

    def next_batch(self):
        B, T = self.B, self.T
        start = self.pos + (self.micro * self.world + self.rank) * B * T
        buf = torch.from_numpy(self.tokens[start:start + B * T + 1].astype(np.int64))  # only this chunk
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)  # inputs, targets
        self.micro += 1
        if self.micro == self.accum:  # this step's run is read: every rank advances alike
            self.micro = 0
            self.pos += self.step_tokens
            self.next_shard_if_short()
        return x, y


# -----------------------------------------------------------------------------
# evaluation: val loss and HellaSwag (each rank its share, all-reduced); samples: sample.py

@torch.no_grad()  # and no graph per batch: each would hold its batch's activations and logits
def evaluate(model, tokens, B, T, device, dtype):
    """(mean loss, bits per byte) over the len(tokens) // T sequences of T tokens, all ranks together;
    rank r scores the sequences r, r + world, ...: the values do not depend on world. Bits per byte
    as nanochat's: the loss in bits of the targets that decode to text over their UTF-8 bytes
    (<|endoftext|>, 0 bytes, is out of both). Every batch has B rows: one shape, one compiled graph."""
    rank, world = process_rank(), world_size()
    model.eval()
    n_seq, n_bytes = (len(tokens) - 1) // T, token_byte_lengths()
    mine = range(rank, n_seq, world)
    sums = torch.zeros(2, device=device)  # the loss summed over all targets, and over those with text
    for i in range(0, len(mine), B):
        rows = np.full((B, T + 1), -1)  # rows past this rank's last sequence: padding, target -1, no loss
        rows[:len(mine[i:i + B])] = [tokens[j * T:j * T + T + 1] for j in mine[i:i + B]]  # (B, T+1)
        text = (n_bytes[rows[:, 1:]] > 0) & (rows[:, 1:] >= 0)  # (B, T): targets that decode to text
        x = torch.from_numpy(rows[:, :-1].clip(0)).to(device)
        y = torch.from_numpy(rows[:, 1:]).to(device)
        with autocast(device, dtype):
            _, losses = model(x, y, reduction='none')  # (B, T)
        sums += torch.stack((losses.sum(), (losses * torch.from_numpy(text).to(device)).sum())).float()
    if world > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    model.train()
    loss_sum, text_loss = sums.tolist()
    return loss_sum / (n_seq * T), text_loss / math.log(2) / max(1, utf8_bytes(tokens[1:n_seq * T + 1]))


def evals_and_samples(state, val_data, hella_data, do_eval, do_sample):
    """This step's val loss (returned, or None) with its bits per byte, and HellaSwag, all ranks
    together, and rank 0's samples; rank 0 prints and logs them. Under FSDP they run on a gathered
    copy of the model, which is freed when this function returns."""
    global phase
    model, raw_model = whole_models(state.model, state.raw_model, state.optimizer, device)
    step, val_loss = state.step, None
    if do_eval:
        phase = 'the val loss'
        val_loss, bpb = evaluate(model, val_data, B, T, device, dtype)
        if rank == 0:
            print(f"step {step:5d} | val loss {val_loss:.4f} | val bpb {bpb:.4f}")
            run_record.log(log_dir, f"{step} val {val_loss:.4f}")
            run_record.log(log_dir, f"{step} bpb {bpb:.4f}")
    if do_eval and hella_data is not None:  # the plain module, its own compiled graph: the same under DDP
        phase = 'HellaSwag'
        from hellaswag import evaluate as evaluate_hellaswag  # imported by the runs that score it (run)
        counts = evaluate_hellaswag(raw_model, hella_data, dtype, compile)  # (examples, acc, acc_norm)
        if world > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # each rank scored its share of the examples
        n, correct, correct_norm = counts.tolist()  # the one host read of the eval
        if rank == 0:
            print(f"step {step:5d} | hellaswag acc_norm {correct_norm}/{n} = {correct_norm / n:.4f} "
                  f"(acc {correct / n:.4f})")
            run_record.log(log_dir, f"{step} hella {correct_norm / n:.4f}")
    lines = []
    if do_sample and rank == 0:
        phase = 'the samples'
        lines = training_samples(raw_model, step, sample_prompt, sample_length, dtype)
    run_record.samples(log_dir, lines)  # seeded by the step: a resumed run writes the same samples
    return val_loss


# -----------------------------------------------------------------------------
# training: one optimizer step, gradient accumulation over micro-batches

def train_step(state, grad_accum_steps, lr, grad_clip, device, dtype):
    """One optimizer step over grad_accum_steps micro-batches: (mean loss, grad norm, ok, overflow).
    A non-finite loss or norm (alike on every rank) skips the update, on the device: the host reads
    nothing before it is queued (docs/ddp.md, 8). overflow: float16 loss scaling at work, not a bad step."""
    model, optimizer, scaler = state.model, state.optimizer, state.scaler
    model.train()
    zero_grad(model, optimizer)  # DDP: in place, in its buckets
    loss_accum = torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        x, y = state.loader.next_batch()
        if pinned(device):  # CUDA copies from pinned memory without the host waiting for them
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # DDP all-reduces (FSDP reduce-scatters) the gradients in the backward of the last micro-step only
        require_backward_grad_sync(model, micro_step == grad_accum_steps - 1)
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss = loss / grad_accum_steps  # the gradient of the mean over all micro-batches
        loss_accum += loss.detach()
        scaler.scale(loss).backward()  # float16: the loss scaled up so that small gradients survive
    if dist.is_initialized():
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)  # gloo has no AVG
        loss_accum /= dist.get_world_size()
    scaler.unscale_(optimizer)  # float16: the gradients back to their true size, before clipping
    norm = clip_grad_norm(model, grad_clip)  # the global norm, the same on every rank
    finite = torch.stack((torch.isfinite(loss_accum), torch.isfinite(norm)))  # on the device: no wait
    for group in optimizer.param_groups:
        group['lr'] = lr * group.get('lr_scale', 1.0)  # muon: its groups' lr is muon_lr / max_lr times lr
    # 1.0 skips the step: fused AdamW (and Muon, gptkit/optim.py) leave weights and state as they are
    optimizer.found_inf = (~finite.all()).float()
    optimizer.step()
    del optimizer.found_inf
    finite_loss, finite_norm = finite.tolist()  # the step's first wait, once its update is queued
    ok = finite_loss and finite_norm
    scale = 0
    if finite_loss and not finite_norm:
        scale = scaler.get_scale()  # read only then: on a GPU it waits
    scaler.update()  # float16: halve the scale after an inf/nan gradient, double it after 2000 clean steps
    # float16: a finite loss's inf/nan gradients lowered the scale; at or below 1 it is a bad step
    overflow = scale > 1 and scaler.get_scale() < scale
    return loss_accum, norm, ok, overflow


# -----------------------------------------------------------------------------
# the run: main sets the constants (as overridden), rank and world; the rest reads them

def main(argv=None):
    global rank, world, device, dtype, compile, config
    master = int(os.environ.get('RANK', 0)) == 0
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, DEFAULTS, __doc__)  # -h: the constants
    except UserError as e:
        sys.exit(f"error: {e}" if master else 1)
    globals().update(config)  # the rest reads the constants, as overridden
    code = error = None
    try:
        rank, world, device = setup_device(device, cpu_reuse_memory, collective_timeout)  # no "auto" now
        config = choose_precision(config, device)  # the same dtype on every rank
        dtype, compile = config['dtype'], config['compile']
        code = run()
    except UserError as e:  # one line on stderr, exit code 1
        error = f"error: {e}"
        if dist.is_initialized() and not master:
            error = ''  # rank 0 says it; a rank says its own only before the ranks can agree
    except RuntimeError as e:  # a collective that gave up waiting (a rank stuck or gone), or out of memory
        error = gave_up(e, rank, phase) or memory.out_of_memory(e, B, phase)
        if error is None:
            raise
    finally:
        if error:
            print(error, file=sys.stderr, flush=True)  # before the teardown, which a gone rank can hold up
        checkpoint.release_log_dir(log_dir, failed=code is None)  # a failed start leaves no log_dir it made
        end_process_group(finished=code is not None)
    if error is not None:
        sys.exit(1)
    run_record.wandb_finish()  # rank 0's upload, after the final barrier: no rank waits on it
    if code:
        sys.exit(code)


def run():
    """Set up the data, the model (fresh, pretrained or resumed) and the optimizer, then train;
    returns the exit code: 0, or checkpoint.EXIT_PREEMPTED after a SIGTERM."""
    global B
    master = rank == 0
    for split in ('train', 'val') if eval_interval > 0 else ('train',):
        find_shards(data_root, split)  # a missing folder is reported before log_dir is made or a model built
    checkpoint.claim_log_dir(log_dir)  # one run per log_dir: rank 0 locks log_dir/run.lock
    torch.manual_seed(seed)  # the same init on every rank (DDP also broadcasts rank 0's weights)

    # resume="auto": the newest checkpoint of log_dir that loads (the same command resumes a stopped run)
    ckpt_path, ckpt = checkpoint.find_checkpoint(log_dir, resume, device)
    raw_model = build_model(ckpt, ckpt_path)
    # B="auto": the most that fit this device's free memory, by count (gptkit/memory.py); every rank the least
    B, why = memory.micro_batch(config, raw_model.config, device, world)
    grad_accum_steps = accumulation_steps(total_batch_size, B, T, world)  # total_batch_size // (B*T*world)
    vocab = raw_model.config.vocab_size
    loader = DataLoaderLite(B, T, rank, world, 'train', data_root, grad_accum_steps, vocab, shuffle, seed)
    val_data = load_val_tokens(data_root, val_tokens // T * T, vocab) if eval_interval > 0 else None
    raw_model.to(device)  # not wrapped: state_dict without prefixes; sharded in place under FSDP
    if parallel == 'fsdp' and dist.is_initialized():  # torchrun; one process is one shard (gpu_check.py)
        shard_fsdp(raw_model)  # before the optimizer, which must see the shards
    device_type = torch.device(device).type
    opt = raw_model.configure_optimizers(weight_decay, max_lr, device_type, optimizer, muon_lr, muon_momentum)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')  # a no-op unless float16
    state = TrainState(raw_model, raw_model, opt, scaler, loader)
    if ckpt is not None:
        checkpoint.restore(state, ckpt, ckpt_path, max_bad_steps)  # says what it resumes from
        del ckpt  # the memory map
        if state.step > max_steps or (state.step == max_steps and state.evaluated):
            if master:
                print(f"nothing to do: {ckpt_path} is step {state.step} and max_steps={max_steps}; raise "
                      f"max_steps to train on, or point log_dir elsewhere to start afresh")
            return 0
    if compile:
        state.model = torch.compile(raw_model, dynamic=False)  # static shapes: one training graph
    if world > 1 and parallel == 'ddp':  # gradients all-reduced during backward; rank 0's weights everywhere
        state.model = wrap_ddp(state.model, device)
    hella_data = None
    if hellaswag and eval_interval > 0:  # imported only by the runs that score it: --help answers sooner
        from hellaswag import load_for_training
        batch = memory.examples_per_batch(B, T)  # made once, on the device; compiled, of one shape
        hella_data = load_for_training(hellaswag_file, raw_model, batch, device, compile)
    if master:  # every check passed: the run starts
        print("config:\n" + "\n".join(f"  {k} = {v!r}" for k, v in config.items()))
        print(f"world_size={world} device={device} grad_accum_steps={grad_accum_steps}")
        if why:
            print(why)
        print(f"parameters: {sum(p.numel() for p in raw_model.parameters()):,}")
        epochs = max_steps / loader.steps_per_epoch
        print(f"train data: {loader.n_tokens:,} tokens, {loader.steps_per_epoch:,} steps per epoch at "
              f"{total_batch_size:,} tokens per step; max_steps={max_steps} is {epochs:.2f} epochs")
        checkpoint.prepare_log_dir(log_dir, state.step, state.evaluated)
        if wandb_log:
            run_record.wandb_start(config, log_dir)
    run_record.write(log_dir, dict(config, B=B, micro_batch=why), state.step, ckpt_path, device)
    return train(state, val_data, hella_data, grad_accum_steps)


def build_model(ckpt, ckpt_path):
    """The model to train, on the CPU: the checkpoint's shape, a fresh one, or OpenAI/HF weights."""
    if ckpt is not None:  # the weights come from the checkpoint: nothing to download
        model = GPT(checkpoint.resumed_model_config(ckpt, ckpt_path, config))
    elif init_from == 'scratch':
        model = GPT(GPTConfig.from_dict(config))
    else:
        first = first_on_node()  # downloads into this node's HF cache while the others wait
        try:
            if first:
                model = GPT.from_pretrained(init_from)
            wait_for_all()  # however long the download takes; then the others read the cache
            if not first:
                model = GPT.from_pretrained(init_from)
        except (ValueError, OSError) as e:  # not a GPT-2, a missing folder, no download
            raise UserError(f"init_from={init_from!r}: {e}") from None
        if rank == 0:
            print(f"init_from={init_from}: model shape from the weights: {model.config}")
    if T > model.config.block_size:
        raise UserError(f"T={T} is longer than the model's block_size={model.config.block_size}")
    return model


def train(state, val_data, hella_data, grad_accum_steps):
    """The loop; returns the exit code. state.step = updates done: the model as it is is evaluated,
    sampled and checkpointed when due, then (unless it is the last step) updated: step -> step + 1."""
    global phase
    master, start = rank == 0, state.step
    checkpoint.listen_for_stop_signals()  # from here SIGTERM and Ctrl-C only set a flag, read between steps
    if master:  # MFU: model FLOPs per second over the peak of all processes' devices
        fpt = flops_per_token(state.raw_model.config, T)
        peak, peak_from = peak_flops(device, dtype)
        if peak:
            print(f"mfu: against {peak / 1e12:.4g} TFLOP/s per process ({peak_from}), "
                  f"{fpt / 1e6:.4g} MFLOP per token")
        else:
            print(f"mfu: {peak_from}")
    wait_for_all()  # rank 0 alone wrote run.json, started W&B and timed a matmul
    for step in range(start, max_steps + 1):
        last_step = step == max_steps
        if agree(bool(checkpoint.stop_requested)):  # SIGTERM or Ctrl-C on any rank: all stop here together
            # evaluated here: the run resumed from this step's checkpoint, which needs no second write
            return checkpoint.stop_on_signal(state, None, state.evaluated, config, keep_checkpoints)
        do_checkpoint = last_step or (checkpoint_interval > 0 and step > 0
                                      and step % checkpoint_interval == 0)
        do_eval = eval_interval > 0 and (step % eval_interval == 0 or last_step or do_checkpoint)
        do_sample = sample_interval > 0 and step > 0 and (step % sample_interval == 0 or last_step)
        if not state.evaluated and (do_eval or do_sample or do_checkpoint):
            val_loss = None
            if do_eval or do_sample:
                val_loss = evals_and_samples(state, val_data, hella_data, do_eval, do_sample)
            state.evaluated = True
            if do_checkpoint:
                phase = 'the checkpoint'
                checkpoint.save_checkpoint(state, val_loss, config, log_dir, keep_checkpoints)
            if not last_step and agree(bool(checkpoint.stop_requested)):  # a stop signal during the evals
                return checkpoint.stop_on_signal(state, val_loss, do_checkpoint, config, keep_checkpoints)
        if last_step:
            return 0

        loader = state.loader
        if master and loader.epoch_begins():
            order = 'a new order' if loader.shuffle else 'in order'
            print(f"step {step:5d} | epoch {loader.epoch} begins ({order})")
            run_record.log(log_dir, f"{step} epoch {loader.epoch}")
        phase = 'the training step'
        t0 = time.time()
        lr = get_lr(step, max_lr, min_lr, warmup_steps, max_steps, lr_schedule, decay_frac, decay_shape)
        loss, norm, ok, overflow = train_step(state, grad_accum_steps, lr, grad_clip, device, dtype)
        loss = loss.item()  # waits for the step to finish: dt is its real time
        dt = time.time() - t0
        if step == start:  # every rank's first graphs are compiled: from here a stuck rank ends the run soon
            hold_to(collective_timeout)
        state.step, state.evaluated = step + 1, False
        if ok:
            state.bad_steps = 0
        elif not overflow:  # a float16 overflow is neither a good step nor a bad one
            state.bad_steps += 1
        if master and step == start:  # what this rank holds: whole tensors under DDP, shards under FSDP
            mib = state_mib(state.raw_model, state.optimizer)
            print(f"parameters, gradients and optimizer state per rank: {mib:.1f} MiB")
            t_first = time.time()  # the first step compiles: the ETA counts from its end
        if master:
            left = max_steps - step - 1
            eta = round(dt * left if step == start else (time.time() - t_first) / (step - start) * left)
            line = (f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm.item():.4f} | "
                    f"dt {dt * 1000:.2f}ms | tok/sec {total_batch_size / dt:.2f} | ")
            if peak:
                line += f"mfu {total_batch_size / dt * fpt / (peak * world):.1%} | "
            line += f"eta {eta // 3600}h{eta % 3600 // 60:02d}m{eta % 60:02d}s"
            run_record.log(log_dir, f"{step} train {loss:.6f}")
            if overflow:
                line += f" | float16 overflow: update skipped, loss scale now {state.scaler.get_scale():g}"
                run_record.log(log_dir, f"{step} overflow {state.scaler.get_scale():g}")
            elif not ok:
                line += (f" | non-finite: update skipped ({state.bad_steps} in a row, "
                         f"max_bad_steps={max_bad_steps})")
                run_record.log(log_dir, f"{step} skip {state.bad_steps}")
            print(line)
        if state.bad_steps >= max_bad_steps:  # stop with a checkpoint: the weights are the last good update's
            checkpoint.stop_after_bad_steps(state, config, keep_checkpoints)


if __name__ == "__main__":
    main()

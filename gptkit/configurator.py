"""
The command line of train_gpt2.py: config files and --key=value overrides of its constants,
checked (hardware.choose_precision then makes dtype and compile "auto" concrete).

    python train_gpt2.py config/gpt2_350M.py --max_steps=100 --dtype=float32

A config file is Python that assigns some of the constants (it may read the others:
max_steps = 2 * warmup_steps), and it runs as code: use only files you trust. --key=value takes
a Python literal, or the text as typed for a string constant. Both are applied in the order
given, and each value must keep its default's type (an int is fine for a float; an "auto"
default also takes True/False, and B a number: AUTO_OR). An unknown key is an error that names
the closest valid ones.
"""
import ast
import builtins
import difflib
import importlib.util
import os
import sys

from gptkit.common import UserError
from gptkit.hardware import PRECISIONS, device_type
from gptkit.optim import DECAY_SHAPES, OPTIMIZERS, SCHEDULES

# nanoGPT's and build-nanogpt's names for this trainer's constants
NANOGPT_NAMES = {'learning_rate': 'max_lr', 'max_iters': 'max_steps', 'lr_decay_iters': 'max_steps',
                 'warmup_iters': 'warmup_steps', 'batch_size': 'B', 'out_dir': 'log_dir', 'dataset': 'data_root',
                 'gradient_accumulation_steps': 'total_batch_size', 'eval_iters': 'val_tokens',
                 'sample_every': 'sample_interval', 'eval_every': 'eval_interval'}

TRAINER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'train_gpt2.py')  # where the constants live
AUTO_OR = {'B': int}  # an "auto" default takes a bool (--compile=False) or a value of this type: --B=16


def parse_config(argv, defaults, doc=""):
    """defaults, updated by config files and --key=value arguments, in the order given. -h or
    --help prints doc and the constants with their defaults, and exits."""
    if '-h' in argv or '--help' in argv:
        print(doc + "\n" + constants_help(defaults))
        sys.exit(0)
    config = dict(defaults)

    def set_key(key, value, source):
        if key not in config:
            close = [NANOGPT_NAMES[key]] if key in NANOGPT_NAMES else []  # what nanoGPT users type
            close += [k for k in difflib.get_close_matches(key, list(config), n=3, cutoff=0.0) if k not in close]
            close = close[:3]
            raise UserError(f"unknown config key {key!r} in {source}; closest valid names: {', '.join(close)}")
        default = config[key]
        if isinstance(default, float) and type(value) is int:
            value = float(value)  # --max_lr=1 means 1.0
        if type(value) is not type(default) and not (default == 'auto' and type(value) in (bool, AUTO_OR.get(key))):
            raise UserError(f"config key {key!r} in {source} must be {type(default).__name__} "
                            f"like its default {default!r}, got {type(value).__name__} {value!r}")
        config[key] = value

    for arg in argv:
        if arg.startswith('--'):
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise UserError(f"expected --key=value, got {arg!r}")
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # a bare word is a string: --init_from=gpt2
            if isinstance(defaults.get(key), str) and not isinstance(value, str) and not (
                    defaults[key] == 'auto' and type(value) in (bool, AUTO_OR.get(key))):
                value = text  # a string key takes the text as typed: --data_root=123
            set_key(key, value, arg)
        else:
            if not os.path.isfile(arg):
                raise UserError(f"config file {arg!r} not found (expected a Python file of constants, e.g. config/NAME.py)")
            namespace = dict(config)  # a file may use the constants: max_steps = 2 * warmup_steps
            try:
                with open(arg) as f:
                    exec(builtins.compile(f.read(), arg, 'exec'), namespace)  # `compile` is a constant here
            except Exception as e:
                raise UserError(f"config file {arg!r} failed: {type(e).__name__}: {e}") from None
            for key, value in namespace.items():
                if key.startswith('_') or callable(value) or type(value).__name__ == 'module':
                    continue
                if key not in config or value is not config[key]:
                    set_key(key, value, arg)
    check_config(config)
    return config


def constants_help(defaults):
    """Each constant, --key=default, with the comment beside it atop train_gpt2.py, under the comment
    lines that head its group there: what -h shows. Read from the source, so it cannot drift; keys
    of another script's own (bench.py's) come last, bare."""
    lines, shown = ["the constants (edit them atop train_gpt2.py, or --key=value / a config file; default shown):"], set()
    with open(TRAINER, encoding='utf-8') as f:
        block = f.read().split('\n# config:', 1)[1].split('\nDEFAULTS = ', 1)[0].splitlines()[1:]
    for line in block:
        key, comment = line.split(' = ', 1)[0], line.partition('  # ')[2]
        if line.startswith('# '):
            lines.append(f"{line[2:]}:")  # a group's heading
        elif key in defaults:
            lines.append((f"  --{key}={defaults[key]!r}".ljust(34) + f" {comment}").rstrip())
            shown.add(key)
    own = [f"  --{k}={v!r}" for k, v in defaults.items() if k not in shown]
    return "\n".join(lines + (["this script's own (its docstring says what they do):"] + own if own else []))


def accumulation_steps(total_batch_size, B, T, world):
    """grad_accum_steps: total_batch_size // (B * T * world), which must divide; else one line
    that says which total_batch_size or B would."""
    per_micro = B * T * world  # every rank takes B*T tokens per micro-step
    if total_batch_size % per_micro == 0:
        return total_batch_size // per_micro
    lo = total_batch_size // per_micro * per_micro
    fits = [b for b in range(B - 1, 0, -1) if total_batch_size % (b * T * world) == 0]
    lower = f" (or lower: {', '.join(map(str, fits[1:3]))}, ...)" if len(fits) > 1 else ""
    raise UserError(f"total_batch_size={total_batch_size} is not a multiple of B*T*world_size = {B}*{T}*{world} = "
                    f"{per_micro}; try {f'{lo} or {lo + per_micro}' if lo else per_micro}, or "
                    + (f"with {world} process(es) use B={fits[0]}{lower}" if fits else "change B"))


def check_config(c):
    if c['B'] != 'auto' and type(c['B']) is not int:
        raise UserError(f"config key 'B' must be 'auto' or a number of sequences, got {c['B']!r}")
    for key in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size', 'total_batch_size', 'B', 'T',
                'collective_timeout'):
        if c[key] != 'auto' and c[key] <= 0:
            raise UserError(f"config key {key!r} must be positive, got {c[key]}")
    for key in ('max_steps', 'warmup_steps', 'eval_interval', 'val_tokens', 'sample_interval', 'sample_length',
                'checkpoint_interval'):
        if c[key] < 0:
            raise UserError(f"config key {key!r} must be >= 0, got {c[key]}")
    # torchrun's processes split the batch evenly: checked before anything starts (B="auto" chooses a divisor)
    accumulation_steps(c['total_batch_size'], 1 if c['B'] == 'auto' else c['B'], c['T'], int(os.environ.get('WORLD_SIZE', 1)))
    if c['eval_interval'] > 0 and c['val_tokens'] < c['T']:
        raise UserError(f"val_tokens={c['val_tokens']} is less than one sequence of T={c['T']} tokens")
    if c['keep_checkpoints'] < 0 or c['max_bad_steps'] < 1:
        raise UserError(f"keep_checkpoints must be >= 0 and max_bad_steps >= 1, got {c['keep_checkpoints']} and {c['max_bad_steps']}")
    if c.get('wandb_log') and importlib.util.find_spec('wandb') is None:  # every rank stops, not rank 0 alone
        raise UserError("wandb_log=True needs the wandb package: pip install -r requirements-wandb.txt")
    if c['parallel'] not in ('ddp', 'fsdp'):
        raise UserError(f"config key 'parallel' must be 'ddp' or 'fsdp', got {c['parallel']!r}")
    for key, allowed in (('lr_schedule', SCHEDULES), ('decay_shape', DECAY_SHAPES), ('optimizer', OPTIMIZERS)):
        if c[key] not in allowed:
            raise UserError(f"config key {key!r} must be {' or '.join(map(repr, allowed))}, got {c[key]!r}")
    if not 0 < c['decay_frac'] <= 1 or c['muon_lr'] <= 0 or not 0 <= c['muon_momentum'] < 1:
        raise UserError(f"decay_frac must be in (0, 1], muon_lr > 0 and muon_momentum in [0, 1), got "
                        f"{c['decay_frac']}, {c['muon_lr']} and {c['muon_momentum']}")
    if c['optimizer'] == 'muon' and c['parallel'] == 'fsdp':  # FSDP's ranks hold shards of each matrix
        raise UserError("optimizer='muon' orthogonalizes whole weight matrices, and parallel='fsdp' gives each rank "
                        "shards of them: use parallel='ddp' with Muon, or optimizer='adamw' with FSDP")
    if c['resume'] not in ('auto', 'never'):
        raise UserError(f"config key 'resume' must be 'auto' or 'never', got {c['resume']!r}")
    if c['n_embd'] % c['n_head']:
        raise UserError(f"n_embd={c['n_embd']} must be a multiple of n_head={c['n_head']}")
    if c['dtype'] not in ('auto', *PRECISIONS):
        raise UserError(f"config key 'dtype' must be 'auto', 'bfloat16', 'float16' or 'float32', got {c['dtype']!r}")
    if c['compile'] not in (True, False, 'auto'):
        raise UserError(f"config key 'compile' must be True, False or 'auto', got {c['compile']!r}")
    if c['device'] != 'auto':
        device_type(c['device'])  # a malformed name: one line now (whether it is here: hardware.pick_device)

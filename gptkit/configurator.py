"""train_gpt2.py's command line: config files (Python assigning constants, so it runs as code: use only files
you trust), then --key=value (a Python literal, or a string's text), each keeping its default's type."""
import ast
import importlib.util
import os

from gptkit.common import UserError
from gptkit.hardware import PRECISIONS, device_type

# nanoGPT's and build-nanogpt's names: an unknown key of theirs suggests ours first, what their users mean
NANOGPT_NAMES = {'learning_rate': 'max_lr', 'max_iters': 'max_steps', 'lr_decay_iters': 'max_steps',
                 'warmup_iters': 'warmup_steps', 'batch_size': 'B', 'out_dir': 'log_dir',
                 'dataset': 'data_root', 'gradient_accumulation_steps': 'total_batch_size',
                 'eval_iters': 'val_tokens', 'sample_every': 'sample_interval', 'eval_every': 'eval_interval'}


def parse_config(argv, defaults, doc=""):
    if '-h' in argv or '--help' in argv:
        print(doc + "\n" + constants_help(defaults))
        raise SystemExit(0)
    config = dict(defaults)

    def fits(key, value):
        return (type(value) is type(defaults[key]) or type(defaults[key]) is float and type(value) is int
                or defaults[key] == 'auto' and type(value) is bool or key == 'B')  # B: check_config checks it

    for arg in argv:
        if arg.startswith('--'):
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise UserError(f"expected --key=value, got {arg!r}")
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # a bare word is a string: --init_from=gpt2
            # a string key takes the text as typed (--data_root=123) unless the literal fits it
            assigned = {key: text if isinstance(defaults.get(key), str) and not fits(key, value) else value}
        elif not os.path.isfile(arg):
            raise UserError(f"config file {arg!r} not found (expected a Python file of constants, "
                            f"e.g. config/NAME.py)")
        else:
            import runpy
            import types
            try:
                namespace = runpy.run_path(arg, init_globals=config)
            except Exception as e:
                raise UserError(f"config file {arg!r} failed: {type(e).__name__}: {e}") from None
            assigned = {key: value for key, value in namespace.items() if not key.startswith('_')
                        and not callable(value) and not isinstance(value, types.ModuleType)}
        for key, value in assigned.items():
            if key not in config:
                import difflib
                close = difflib.get_close_matches(NANOGPT_NAMES.get(key, key), list(config), n=3, cutoff=0.0)
                raise UserError(f"unknown config key {key!r} in {arg}; closest valid names: "
                                f"{', '.join(close)}")
            if not fits(key, value):
                raise UserError(f"config key {key!r} in {arg} must be {type(defaults[key]).__name__} "
                                f"like its default {defaults[key]!r}, got {type(value).__name__} {value!r}")
            config[key] = float(value) if type(defaults[key]) is float else value  # --max_lr=1 means 1.0
    check_config(config)
    return config


def trainer_constants():
    # train_gpt2.py's constants as text: -h shows the comments written there (no copy), without running it
    with open(os.path.join(os.path.dirname(__file__), '..', 'train_gpt2.py'), encoding='utf-8') as f:
        source = f.read()
    return source[source.index('\n# config:'):source.index('\nDEFAULTS = ')]


def constants_help(defaults):
    block = trainer_constants()
    lines = ["the constants (edit them atop train_gpt2.py, or --key=value / a config file; default shown):"]
    for line in block.splitlines()[2:]:
        key = line.split(' = ')[0]
        if line.startswith('# '):
            lines.append(f"{line[2:]}:")
        elif key in defaults:
            lines.append(f"  --{key}={defaults[key]!r}".ljust(34) + f" {line.partition('  # ')[2]}")
    own = [f"  --{k}={v!r}" for k, v in defaults.items() if f"\n{k} = " not in block]
    if own:
        lines += ["this script's own (its docstring says what they do):", *own]
    return "\n".join(lines)


def trainer_defaults():
    return {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(trainer_constants()).body}


def accumulation_steps(total_batch_size, B, T, world):
    per_micro = B * T * world
    if total_batch_size % per_micro == 0:
        return total_batch_size // per_micro
    lo = total_batch_size // per_micro * per_micro
    fits = [b for b in range(B - 1, 0, -1) if total_batch_size % (b * T * world) == 0]
    lower = f" (or lower: {', '.join(map(str, fits[1:3]))}, ...)" if len(fits) > 1 else ""
    try_instead = f"with {world} process(es) use B={fits[0]}{lower}" if fits else "change B"
    raise UserError(f"total_batch_size={total_batch_size} is not a multiple of B*T*world_size = "
                    f"{B}*{T}*{world} = {per_micro}; try {f'{lo} or {lo + per_micro}' if lo else per_micro}, "
                    f"or {try_instead}")


CHOICES = {'parallel': ('ddp', 'fsdp'), 'decay_shape': ('linear', '1-sqrt'),  # lr_schedule: train_gpt2.py's
           'optimizer': ('adamw', 'muon'), 'resume': ('auto', 'never'),
           'dtype': ('auto', *sorted(PRECISIONS)), 'compile': (True, False, 'auto')}


def check_config(c):
    """One line for the first constant out of its range: every rank stops before anything starts."""
    if c['B'] != 'auto' and type(c['B']) is not int:  # first: the checks below compare it with 0
        raise UserError(f"config key 'B' must be 'auto' or a number of sequences, got {c['B']!r}")
    ranges = ([(key, 'positive', c[key] == 'auto' or c[key] > 0) for key in (
                  'n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size', 'total_batch_size', 'B', 'T',
                  'collective_timeout', 'muon_lr', 'max_bad_steps')]
              + [(key, '>= 0', c[key] >= 0) for key in (
                  'max_steps', 'warmup_steps', 'eval_interval', 'val_tokens', 'sample_interval',
                  'sample_length', 'checkpoint_interval', 'keep_checkpoints')]
              + [('decay_frac', 'in (0, 1]', 0 < c['decay_frac'] <= 1),
                 ('muon_momentum', 'in [0, 1)', 0 <= c['muon_momentum'] < 1)]
              + [(key, f"{', '.join(map(repr, allowed[:-1]))} or {allowed[-1]!r}", c[key] in allowed)
                 for key, allowed in CHOICES.items()])
    for key, allowed, ok in ranges:
        if not ok:
            raise UserError(f"config key {key!r} must be {allowed}, got {c[key]!r}")
    # torchrun's processes split the batch evenly (B="auto" chooses a divisor)
    accumulation_steps(c['total_batch_size'], 1 if c['B'] == 'auto' else c['B'], c['T'],
                       int(os.environ.get('WORLD_SIZE', 1)))
    if c['eval_interval'] > 0 and c['val_tokens'] < c['T']:
        raise UserError(f"val_tokens={c['val_tokens']} is less than one sequence of T={c['T']} tokens")
    if c['n_embd'] % c['n_head']:
        raise UserError(f"n_embd={c['n_embd']} must be a multiple of n_head={c['n_head']}")
    if c['optimizer'] == 'muon' and c['parallel'] == 'fsdp':  # FSDP's ranks hold shards of each matrix
        raise UserError("optimizer='muon' orthogonalizes whole weight matrices, which parallel='fsdp' shards "
                        "across ranks: use parallel='ddp' with Muon, or optimizer='adamw' with FSDP")
    if c.get('wandb_log') and importlib.util.find_spec('wandb') is None:  # every rank stops, not rank 0 alone
        raise UserError("wandb_log=True needs the wandb package: pip install -r requirements-wandb.txt")
    if c['device'] != 'auto':
        device_type(c['device'])  # a malformed name: one line now (whether it is here: hardware.pick_device)

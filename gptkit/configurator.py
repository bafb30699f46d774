"""
The command line of train_gpt2.py: config files and --key=value overrides of its constants,
checked (hardware.choose_precision then makes dtype and compile "auto" concrete).

    python train_gpt2.py config/gpt2_350M.py --max_steps=100 --dtype=float32

A config file is Python that assigns some of the constants (it may read the others:
max_steps = 2 * warmup_steps), and it runs as code: use only files you trust. --key=value takes
a Python literal, or the text as typed for a string constant. Both are applied in the order
given, and each value must keep its default's type (an int is fine for a float; an "auto"
default also takes True/False, and B a number or "auto", whatever its default). An unknown key
is an error that names the closest valid ones.
"""
import ast
import os

from gptkit.common import UserError
from gptkit.hardware import PRECISIONS, device_type

TRAINER = os.path.join(os.path.dirname(__file__), '..', 'train_gpt2.py')  # its constants: what --help shows


def parse_config(argv, defaults, doc=""):
    """defaults, updated by config files and --key=value arguments, in the order given. -h or
    --help prints doc and the constants with their defaults, and exits."""
    if '-h' in argv or '--help' in argv:
        print(doc + "\n" + constants_help(defaults))
        raise SystemExit(0)
    config = dict(defaults)

    # the default's type (an int for a float); an "auto" default also takes a bool; B takes whatever is
    # given (a number, or "auto", whatever its default): check_config's line says what it must be
    def fits(key, value):
        return (type(value) is type(defaults[key]) or type(defaults[key]) is float and type(value) is int
                or defaults[key] == 'auto' and type(value) is bool or key == 'B')

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
            import runpy  # only a config file needs these two
            import types
            # run as python runs a script (its errors name the file), the constants in sight: a file may
            # use them (max_steps = 2 * warmup_steps)
            try:
                namespace = runpy.run_path(arg, init_globals=config)
            except Exception as e:
                raise UserError(f"config file {arg!r} failed: {type(e).__name__}: {e}") from None
            # what it assigns; not its imports, functions or _private names
            assigned = {key: value for key, value in namespace.items() if not key.startswith('_')
                        and not callable(value) and not isinstance(value, types.ModuleType)}
        for key, value in assigned.items():
            if key not in config:
                import difflib
                # nanoGPT's and build-nanogpt's names for this trainer's constants: for one of them, ours
                # comes first, as that is what its users type
                nanogpt_names = {'learning_rate': 'max_lr', 'max_iters': 'max_steps',
                                 'lr_decay_iters': 'max_steps', 'warmup_iters': 'warmup_steps',
                                 'batch_size': 'B', 'out_dir': 'log_dir', 'dataset': 'data_root',
                                 'gradient_accumulation_steps': 'total_batch_size',
                                 'eval_iters': 'val_tokens', 'sample_every': 'sample_interval',
                                 'eval_every': 'eval_interval'}
                close = difflib.get_close_matches(nanogpt_names.get(key, key), list(config), n=3, cutoff=0.0)
                raise UserError(f"unknown config key {key!r} in {arg}; closest valid names: "
                                f"{', '.join(close)}")
            if not fits(key, value):
                raise UserError(f"config key {key!r} in {arg} must be {type(defaults[key]).__name__} "
                                f"like its default {defaults[key]!r}, got {type(value).__name__} {value!r}")
            config[key] = float(value) if type(defaults[key]) is float else value  # --max_lr=1 means 1.0
    check_config(config)
    return config


def constants_help(defaults):
    """Each constant, --key=default, with the comment beside it atop train_gpt2.py, under the comment
    lines that head its group there: what -h shows. Read from the source, so it cannot drift; keys
    of another script's own (bench.py's) come last, bare."""
    with open(TRAINER, encoding='utf-8') as f:
        source = f.read()
    # the block between the '# config: ...' line and DEFAULTS: group headings ('# I/O') and the
    # constants, one a line: `key = value  # comment`
    block = source[source.index('\n# config:'):source.index('\nDEFAULTS = ')]
    lines = ["the constants (edit them atop train_gpt2.py, or --key=value / a config file; default shown):"]
    for line in block.splitlines()[2:]:
        key = line.split(' = ')[0]
        comment = line.partition('  # ')[2]
        if line.startswith('# '):
            lines.append(f"{line[2:]}:")  # a group's heading
        elif key in defaults:
            lines.append(f"  --{key}={defaults[key]!r}".ljust(34) + f" {comment}")
    own = [f"  --{k}={v!r}" for k, v in defaults.items() if f"\n{k} = " not in block]
    if own:
        lines += ["this script's own (its docstring says what they do):", *own]
    return "\n".join(lines)


def trainer_defaults():
    """train_gpt2.py's constants with their defaults, read from its source (importing the flat script
    would run it): for the tools and tests that take its config."""
    with open(TRAINER, encoding='utf-8') as f:
        source = f.read()
    block = source[source.index('\n# config:'):source.index('\nDEFAULTS = ')]
    return {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(block).body}


def accumulation_steps(total_batch_size, B, T, world):
    """grad_accum_steps: total_batch_size // (B * T * world), which must divide; else one line
    that says which total_batch_size or B would."""
    per_micro = B * T * world  # every rank takes B*T tokens per micro-step
    if total_batch_size % per_micro == 0:
        return total_batch_size // per_micro
    lo = total_batch_size // per_micro * per_micro
    fits = [b for b in range(B - 1, 0, -1) if total_batch_size % (b * T * world) == 0]
    lower = f" (or lower: {', '.join(map(str, fits[1:3]))}, ...)" if len(fits) > 1 else ""
    try_instead = f"with {world} process(es) use B={fits[0]}{lower}" if fits else "change B"
    raise UserError(f"total_batch_size={total_batch_size} is not a multiple of B*T*world_size = "
                    f"{B}*{T}*{world} = {per_micro}; try {f'{lo} or {lo + per_micro}' if lo else per_micro}, "
                    f"or {try_instead}")


# the constants that take one of a few values (lr_schedule: train_gpt2.py's LR_SCHEDULES, beside get_lr)
CHOICES = {'parallel': ('ddp', 'fsdp'), 'decay_shape': ('linear', '1-sqrt'),
           'optimizer': ('adamw', 'muon'), 'resume': ('auto', 'never'),
           'dtype': ('auto', *sorted(PRECISIONS)), 'compile': (True, False, 'auto')}


def check_config(c):
    """One line for the first constant out of its range, naming it: a bad value stops the run
    before anything starts, on every rank."""
    if c['B'] != 'auto' and type(c['B']) is not int:  # first: the checks below compare it with 0
        raise UserError(f"config key 'B' must be 'auto' or a number of sequences, got {c['B']!r}")
    # (key, what it must be, whether it is), in the order they are checked
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
    # torchrun's processes split the batch evenly: checked before anything starts (B="auto" chooses a divisor)
    accumulation_steps(c['total_batch_size'], 1 if c['B'] == 'auto' else c['B'], c['T'],
                       int(os.environ.get('WORLD_SIZE', 1)))
    if c['eval_interval'] > 0 and c['val_tokens'] < c['T']:
        raise UserError(f"val_tokens={c['val_tokens']} is less than one sequence of T={c['T']} tokens")
    if c['n_embd'] % c['n_head']:
        raise UserError(f"n_embd={c['n_embd']} must be a multiple of n_head={c['n_head']}")
    if c['optimizer'] == 'muon' and c['parallel'] == 'fsdp':  # FSDP's ranks hold shards of each matrix
        raise UserError("optimizer='muon' orthogonalizes whole weight matrices, and parallel='fsdp' gives "
                        "each rank shards of them: use parallel='ddp' with Muon, or optimizer='adamw' with "
                        "FSDP")
    if c.get('wandb_log'):  # every rank stops without it, not rank 0 alone
        import importlib.util  # wandb's runs alone look for it
        if importlib.util.find_spec('wandb') is None:
            raise UserError("wandb_log=True needs the wandb package: pip install -r requirements-wandb.txt")
    if c['device'] != 'auto':
        device_type(c['device'])  # a malformed name: one line now (whether it is here: hardware.pick_device)

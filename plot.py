"""
Plot training runs from their log.txt: loss (train raw and smoothed, val), val bits per byte and
HellaSwag acc_norm; a panel appears when some log has its lines.

    python plot.py LOG_DIR [LOG_DIR ...] --out runs.png

Reads this trainer's log_dir/log.txt and build-nanogpt's (the same "{step} {kind} {value}" lines:
train, val, bpb, hella; skip and overflow lines are ignored). Several folders are overlaid, each
labelled by its folder name. The smoothed train curve is a local straight-line fit: it follows the
loss without lagging behind it, to the last step. Reference lines: OpenAI's GPT-2 124M val loss on
FineWeb-Edu (3.2924), drawn only when some run's val loss is FineWeb-Edu's too (its run.json's
dataset, or a build-nanogpt log dir, which has no run.json): on other data the number means nothing;
and HellaSwag acc_norm, the same eval whatever the training data: GPT-2 124M 0.2955 with this
project's scorer (docs/hellaswag.md), GPT-3 124M 0.337 (the GPT-3 paper). Headless: writes the PNG,
needs no display.
"""
import argparse
import json
import math
import os
import statistics
import sys

from gptkit.common import UserError, atomic_write
from gptkit.shards import FINEWEB_EDU

KINDS = ('train', 'val', 'bpb', 'hella', 'epoch')  # drawn; epoch: '{step} epoch {n}' where epoch n begins
# the reference lines of each panel. loss: GPT-2's val loss on FineWeb-Edu's val shard, drawn only over
# FineWeb-Edu runs; hella 0.2955: build-nanogpt's hellaswag.py on the 10,042 val examples (its notebook
# draws 0.2945)
REFERENCE = {'loss': [(3.2924, 'GPT-2 124M (OpenAI), FineWeb-Edu val loss')],
             'hella': [(0.2955, 'GPT-2 124M (OpenAI)'), (0.337, 'GPT-3 124M (paper)')]}
TITLES = {'loss': 'loss', 'bpb': 'val bits per byte', 'hella': 'HellaSwag acc_norm'}


def read_log(log_dir):
    """{kind: ([steps], [values])} of KINDS from log_dir/log.txt. Lines of other kinds (skip,
    overflow, whatever a user's trainer adds) are passed over quietly; unparsable ones with a warning
    that names them."""
    path = os.path.join(log_dir, 'log.txt')
    if not os.path.isdir(log_dir):
        raise UserError(f"{log_dir}: no such folder")
    if not os.path.isfile(path):
        raise UserError(f"{log_dir}: no log.txt in this folder (is it a run's log_dir?)")
    curves = {kind: ([], []) for kind in KINDS}
    with open(path, errors='replace') as f:
        for lineno, line in enumerate(f, 1):
            try:
                step, kind, value = line.split()  # a ValueError unless three words
                step = int(step)
                value = float(value)
            except ValueError:
                if line.strip():
                    print(f"warning: {path}:{lineno}: not a '<step> <kind> <value>' line, "
                          f"skipped: {line.strip()[:80]!r}", file=sys.stderr)
                continue
            if kind in KINDS:
                curves[kind][0].append(step)
                curves[kind][1].append(value)
    return curves


def is_fineweb_edu(dataset, data_root):
    """Whether a run's data is FineWeb-Edu: dataset as shards.dataset_of says; without one (shards
    with no manifest, like build-nanogpt's, or a run.json older than the key), data_root named as its
    folders are."""
    if dataset is not None:
        return dataset.split(' ')[0] == FINEWEB_EDU
    name = os.path.basename(os.path.normpath(data_root)).lower()
    return 'fineweb' in name and 'edu' in name


def trained_on_fineweb_edu(log_dir):
    """Whether log_dir's val loss is measured on FineWeb-Edu, as GPT-2's reference val loss is: the
    dataset of run.json's last entry (its latest start), or its data_root's name (is_fineweb_edu).
    No run.json: a build-nanogpt log dir, which trains on FineWeb-Edu only. An unreadable run.json: no."""
    path = os.path.join(log_dir, 'run.json')
    if not os.path.isfile(path):
        return True
    try:
        with open(path) as f:
            last = json.load(f)[-1]
        return is_fineweb_edu(last.get('dataset'), last['config']['data_root'])
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as e:  # edited by hand, or not ours
        print(f"warning: {path}: not a run.json list of entries ({type(e).__name__}: {e}); its val loss is "
              f"not taken for FineWeb-Edu's", file=sys.stderr)
        return False


def smooth(values, half=10):
    """A local straight-line fit: each value becomes the value at its step of the least-squares line
    through the finite values up to `half` steps either side (one side only at the ends). It does
    not lag, as an exponential average does (by about its length: above a falling loss by its
    slope times that), a straight stretch comes back as it is, and the newest value is smoothed
    too. A non-finite value (a skipped step's nan) stays nan, a gap as in the raw curve, and is
    left out of its neighbours' fits."""
    def fit(i):  # the line's intercept: its value at x = 0, this step; one point alone is itself
        first = max(0, i - half)
        near = [(j - i, v) for j, v in enumerate(values[first:i + half + 1], first) if math.isfinite(v)]
        return statistics.linear_regression(*zip(*near)).intercept if len(near) > 1 else values[i]
    return [fit(i) if math.isfinite(v) else math.nan for i, v in enumerate(values)]


def plot(runs, out, fineweb_edu=False):
    """runs: [(label, curves)]; writes out (PNG): the loss panel, then val bits per byte and
    HellaSwag side by side when some run logged them. fineweb_edu: some run's val loss is on
    FineWeb-Edu (trained_on_fineweb_edu), so GPT-2's val loss is drawn to compare with."""
    import matplotlib
    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt
    kinds = ['loss'] + [kind for kind in ('bpb', 'hella') if any(c[kind][0] for _, c in runs)]
    fig, ax = plt.subplot_mosaic([kinds], figsize=(7 * len(kinds), 5))  # one row: {kind: its panel}
    loss = ax['loss']
    for i, (label, c) in enumerate(runs):
        color = f"C{i}"
        steps, train = c['train']
        if train:
            loss.plot(steps, train, color=color, alpha=0.2, linewidth=0.8)
            loss.plot(steps, smooth(train), color=color, label=f"{label} train (smoothed)")
        if c['val'][0]:
            loss.plot(*c['val'], color=color, linestyle='--', marker='.', label=f"{label} val")
        for kind in kinds[1:]:
            if c[kind][0]:
                ax[kind].plot(*c[kind], color=color, marker='.', label=label)
        for j, step in enumerate(c['epoch'][0]):  # where the train data starts again, in a new order
            loss.axvline(step, color=color, linestyle='-.', linewidth=0.8,
                         label=None if j else f"{label} new epoch")
    refs = dict(REFERENCE, loss=REFERENCE['loss'] if fineweb_edu else [])
    for kind, a in ax.items():
        for (y, text), color in zip(refs.get(kind, []), ('red', 'green')):
            a.axhline(y, color=color, linestyle=':', linewidth=1, label=f"{text}: {y}")
        a.set(xlabel='step', title=TITLES[kind])
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    loss.set_ylim(top=min(loss.get_ylim()[1], 12))  # a random init's ~11 would flatten the rest
    fig.tight_layout()
    atomic_write(out, lambda f: fig.savefig(f, format='png', dpi=100))  # a whole picture or none
    panels = [(a.get_title(), [line.get_label() for line in a.get_lines()]) for a in ax.values()]
    plt.close(fig)
    return panels  # [(title, curve labels)] of the panels, left to right


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('log_dirs', nargs='+', metavar='LOG_DIR', help="a run's log_dir (holds log.txt)")
    p.add_argument('--out', default='runs.png', help="the PNG to write (default: runs.png)")
    args = p.parse_args(argv)
    runs = []
    for log_dir in args.log_dirs:
        try:
            curves = read_log(log_dir)
        except (UserError, OSError) as e:
            sys.exit(f"error: {e}")
        if not any(values for _, values in curves.values()):
            sys.exit(f"error: {os.path.join(log_dir, 'log.txt')}: no train, val, bpb or hella lines")
        runs.append((os.path.basename(os.path.normpath(log_dir)), curves))
    try:
        # a list, not a generator: each unreadable run.json gets its warning
        panels = plot(runs, args.out, fineweb_edu=any([trained_on_fineweb_edu(d) for d in args.log_dirs]))
    except OSError as e:
        sys.exit(f"error: cannot write --out {args.out}: {e}")
    print(f"wrote {args.out}: {', '.join(label for label, _ in runs)}")
    return panels  # for the tests: what was drawn


if __name__ == "__main__":
    main()

"""
The learning rate of each step, a pure function of the step and the constants (so a resumed run
continues its schedule): linear warmup over warmup_steps, then

- "cosine" (the default, build-nanogpt's): cosine decay from max_lr to min_lr at max_steps;
- "wsd" (warmup-stable-decay, "trapezoidal"): constant at max_lr, then a decay to min_lr over the
  last decay_frac of max_steps, "linear" or "1-sqrt" in shape. Only the decay depends on
  max_steps: a run whose max_steps is raised before its decay began resumes in its stable phase
  and decays later (docs/recipes.md).
"""
import math

SCHEDULES = ('cosine', 'wsd')
DECAY_SHAPES = ('linear', '1-sqrt')


def get_lr(step, max_lr, min_lr, warmup_steps, max_steps, schedule='cosine', decay_frac=0.2, decay_shape='linear'):
    if step < warmup_steps:  # linear warmup, never exactly 0
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    if schedule == 'cosine':
        ratio = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)
    decay_steps = max(1, round(decay_frac * max_steps))
    progress = (step - (max_steps - decay_steps)) / decay_steps  # <= 0 in the stable phase, -> 1 at max_steps
    if progress <= 0:
        return max_lr
    fall = progress if decay_shape == 'linear' else math.sqrt(progress)  # 1-sqrt: quick at first, gentle at the end
    return max_lr - fall * (max_lr - min_lr)

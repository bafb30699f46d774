"""
What the tools (hellaswag.py, sample.py, export_hf.py) load a model from: an OpenAI name, a HF model
folder, a train_gpt2.py checkpoint, or a run's log_dir (its newest checkpoint). The trainer reads
its own checkpoints with gptkit/checkpoint.py.
"""
import os
import pickle
import sys

from gptkit import checkpoint
from gptkit.common import UserError
from model import GPT, OPENAI_MODELS, GPTConfig


def model_in(name):
    """name, or where name is a run's log_dir (a folder of model_NNNNN.pt, no HF config.json), the
    path of its newest checkpoint, said on stderr: for the tools that take --model."""
    if not os.path.isdir(name) or os.path.isfile(os.path.join(name, 'config.json')):
        return name
    found = checkpoint.list_checkpoints(name)
    if not found:
        raise UserError(f"{name}: neither a HF model folder (no config.json) nor a run's log_dir "
                        f"(no model_NNNNN.pt)")
    print(f"{name}: its newest checkpoint, {found[0][1]}", file=sys.stderr)
    return found[0][1]


# what reading something other than a train_gpt2.py checkpoint raises: a missing file, a file cut short
# or of another format (checkpoint.load's ValueError), build-nanogpt's pickled GPTConfig
# (UnpicklingError), other keys or shapes
NOT_A_CHECKPOINT = (OSError, RuntimeError, KeyError, TypeError, AttributeError, ValueError,
                    pickle.UnpicklingError)


def unreadable_checkpoint(path, error):
    return ValueError(f"{path}: not a readable train_gpt2.py checkpoint ({type(error).__name__}: {error})")


def read_checkpoint_weights(path):
    """(GPTConfig, state dict) of a train_gpt2.py checkpoint, for the tools: the tensors memory-
    mapped, nothing unpickled but tensors and plain values. Anything else is a ValueError."""
    try:
        ckpt = checkpoint.load(path)
        return GPTConfig.from_dict(ckpt['config']), ckpt['model']
    except NOT_A_CHECKPOINT as e:
        raise unreadable_checkpoint(path, e) from None


def load_model(name, device):
    """An OpenAI name, a HF model folder, a train_gpt2.py checkpoint (.pt), or a run's log_dir."""
    name = model_in(name)
    if name in OPENAI_MODELS:  # through HF, which has its own init
        return GPT.from_pretrained(name).to(device).eval()
    if name.endswith('.pt'):
        config, state = read_checkpoint_weights(name)
        try:
            model = GPT.empty(config)
            model.load_state_dict(state)  # strict: every weight
        except NOT_A_CHECKPOINT as e:  # a config or weights that are not a GPT's
            raise unreadable_checkpoint(name, e) from None
    else:
        model = GPT.from_pretrained(name)  # every weight, or an error
    return model.to(device).eval()

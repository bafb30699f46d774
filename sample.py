"""
Sample text from a GPT-2: a train_gpt2.py checkpoint, a HF GPT-2 folder or an OpenAI name.

    python sample.py --model log/model_19073.pt --prompt "Hello, I'm a language model,"
    python sample.py --model gpt2 --prompt FILE:prompt.txt --num_samples 3 --max_new_tokens 200 --top_k 200

Generation is KV-cached (model.py's GPT.generate); each sample is printed, prompt included, as soon
as it is done. The same --seed gives the same text on the same machine.
"""
import argparse
import sys

import torch

from gptkit.common import UserError
from gptkit.hardware import autocast, pick_device, resolve_dtype
from gptkit.tokenizer import EOT, N_VOCAB, get_gpt2_encoding


def encode_prompt(prompt, model):
    """Token ids of prompt (GPT-2's <|endoftext|> alone when it is empty, as GPT-2 starts
    unconditional samples), checked against the model's vocabulary and length."""
    enc = get_gpt2_encoding()
    if model.config.vocab_size < N_VOCAB:
        raise UserError(f"the model's vocab_size={model.config.vocab_size} is smaller than GPT-2's "
                        f"{N_VOCAB}: its tokens are not GPT-2's")
    ids = enc.encode(prompt) or [EOT]
    block = model.config.block_size
    if len(ids) > block:  # generate would keep the last block_size tokens anyway
        print(f"warning: the prompt's {len(ids)} tokens are more than block_size={block}: "
              f"it continues the last {block}", file=sys.stderr)
    return ids[-block:]


def decode(ids):
    return get_gpt2_encoding().decode([t for t in ids if t < N_VOCAB])  # a padded vocabulary's: no text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default='gpt2',
                   help="a .pt checkpoint, a run's log_dir (its newest checkpoint), a HF GPT-2 folder, or "
                        "gpt2/-medium/-large/-xl")
    p.add_argument('--prompt', default="Hello, I'm a language model,",
                   help="the text to continue, or FILE:path")
    p.add_argument('--num_samples', type=int, default=4)
    p.add_argument('--max_new_tokens', type=int, default=100)
    p.add_argument('--temperature', type=float, default=1.0, help="< 1 sharper, > 1 more random")
    p.add_argument('--top_k', type=int, default=50, help="sample among the k likeliest tokens; 0: all")
    p.add_argument('--seed', type=int, default=1337)
    p.add_argument('--device', default='auto', help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    p.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'])
    args = p.parse_args(argv)
    prompt = args.prompt
    if prompt.startswith('FILE:'):
        try:
            with open(prompt[5:], encoding='utf-8') as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            sys.exit(f"error: --prompt {args.prompt}: cannot read it ({e})")
    from gptkit.loading import load_model  # here, not atop: `import sample` stays light
    try:
        device = pick_device(args.device)
        dtype, _ = resolve_dtype(args.dtype, device)
        model = load_model(args.model, device)
        idx = torch.tensor([encode_prompt(prompt, model)], dtype=torch.long, device=device)
        generator = torch.Generator(device=device).manual_seed(args.seed)
    except (UserError, ValueError, OSError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    for i in range(args.num_samples):  # one at a time: each is printed when it is done
        with autocast(device, dtype):
            out = model.generate(idx, args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k or None, generator=generator)
        print(f"--- sample {i}\n{decode(out[0].tolist())}", flush=True)


if __name__ == "__main__":
    main()

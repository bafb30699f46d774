"""
HellaSwag, the tool: a model's acc and acc_norm on HellaSwag, whole process, as build-nanogpt's
hellaswag.py measures them (the scoring, batched, lives in gptkit/hellaswag_eval.py; the trainer's evals
call it too). Also made-up examples in HellaSwag's format, for benchmarks and checks.

    python hellaswag.py --model gpt2                # OpenAI GPT-2 124M (HF): acc 0.2859 acc_norm 0.2955
    python hellaswag.py --model log/model_19073.pt   # a checkpoint of train_gpt2.py
    python hellaswag.py --model path/to/hf_dir --file hellaswag_val.jsonl --limit 500
"""
import json

from gptkit.common import UserError
from gptkit.hardware import pick_device
from gptkit.hellaswag_eval import evaluate, iterate_examples, prepare


def synthetic_examples(n, seed=0):
    """n made-up examples in HellaSwag's format, for benchmarks and checks: as long as the val
    split's first ones (ActivityNet captions, the ones --limit takes), contexts of 6-36 words,
    endings of 3-20."""
    import random
    rng = random.Random(seed)
    words = ("a the man woman boy girl people is are then seen shown standing holding ball dog camera "
             "while with on in into front of water field kitchen begins continues to walk talk play "
             "smiles jumps runs pushes pulls down up around and his her their").split()
    text = lambda lo, hi: " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    return [{"ind": i, "activity_label": "Synthetic", "ctx": text(6, 36).capitalize() + ". the man",
             "split": "val", "label": rng.randrange(4), "endings": [text(3, 20) + "." for _ in range(4)]}
            for i in range(n)]


def write_synthetic(path, n, seed=0):
    """synthetic_examples(n, seed) as a HellaSwag jsonl file, one example per line."""
    with open(path, 'w') as f:
        for example in synthetic_examples(n, seed):
            f.write(json.dumps(example) + "\n")


def main(argv=None):
    import argparse
    import sys
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default='gpt2', help="gpt2 (or -medium, -large, -xl), a HF model folder, a .pt "
                                                   "checkpoint, or a run's log_dir (its newest checkpoint)")
    p.add_argument('--file', default=None,
                   help="a local HellaSwag jsonl file (default: the split, downloaded once)")
    p.add_argument('--split', default='val', choices=['train', 'val'])
    p.add_argument('--device', default='auto')
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    p.add_argument('--limit', type=int, default=0, help="score only the first N examples")
    p.add_argument('--batch_examples', type=int, default=32,
                   help="examples per batch (default: %(default)s)")
    args = p.parse_args(argv)
    from gptkit.loading import load_model  # here: `import hellaswag` (tests, bench.py) stays light
    try:
        device = pick_device(args.device)
        examples = list(iterate_examples(args.split, args.file))[:args.limit or None]
    except UserError as e:
        sys.exit(f"error: {e}")
    if device == 'cpu':
        from gptkit.cpu import reuse_freed_memory
        reuse_freed_memory()  # no page faults per forward (docs/benchmarks.md)
    try:
        model = load_model(args.model, device)
    except (UserError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    from tqdm import tqdm
    batches, labels = prepare(examples, model.config.block_size, device, args.batch_examples)
    n, correct, correct_norm = evaluate(model, (tqdm(batches, desc="score"), labels), args.dtype).tolist()
    print(f"acc: {correct / n:.4f} acc_norm: {correct_norm / n:.4f}")


if __name__ == "__main__":
    main()

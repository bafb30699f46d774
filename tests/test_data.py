import numpy as np
import pytest
import torch

from conftest import write_shards
from gptkit.common import UserError
from gptkit.shards import DataLoaderLite, load_val_tokens

B, T = 2, 4  # chunks of 8 tokens


def expected_runs(lengths, step_tokens, n_steps):
    """Brute force: each step reads the next run of step_tokens + 1 tokens that fits in a shard,
    shards in order and wrapping around; returns (shard, start) per step."""
    runs = [(s, p) for s, n in enumerate(lengths) for p in range(0, n - step_tokens, step_tokens)]
    return [runs[i % len(runs)] for i in range(n_steps)]


def make_shards(tmp_path, lengths):
    """Shard s holds s * 10000 + position, so every token tells where it came from."""
    write_shards(tmp_path, "train", [s * 10000 + np.arange(n) for s, n in enumerate(lengths)])


# lengths that make build-nanogpt's ranks drift: rank 0 still fits a batch where rank 1 does not
@pytest.mark.quick
@pytest.mark.parametrize("world,accum,lengths", [
    (2, 1, [5 * 16 + 8 + 1, 3 * 16 + 9, 40]),
    (2, 2, [3 * 32 + 16 + 1, 2 * 32 + 1, 70]),
    (3, 2, [2 * 48 + 24 + 5, 49, 100]),
])
def test_ranks_disjoint_cover_and_lockstep(tmp_path, world, accum, lengths):
    make_shards(tmp_path, lengths)
    loaders = [DataLoaderLite(B, T, r, world, "train", str(tmp_path), accum_steps=accum)
               for r in range(world)]
    step_tokens = B * T * world * accum
    for shard, start in expected_runs(lengths, step_tokens, 12):
        run = shard * 10000 + np.arange(start, start + step_tokens + 1)
        got = []
        for m in range(accum):
            for r, loader in enumerate(loaders):
                x, y = loader.next_batch()
                assert x.dtype == torch.int64 and x.shape == (B, T)
                assert np.array_equal(y.flatten().numpy()[:-1], x.flatten().numpy()[1:])
                got.append((m * world + r, x.flatten().numpy(), y[-1, -1].item()))
        # chunk m*world + r of the run went to rank r at micro-step m: disjoint, covering the run
        for k, xs, last_target in sorted(got, key=lambda g: g[0]):
            assert np.array_equal(xs, run[k * B * T:(k + 1) * B * T])
            assert last_target == run[(k + 1) * B * T]
        assert len({loader.shard for loader in loaders}) == 1  # every rank on the same shard


@pytest.mark.quick
def test_stream_does_not_depend_on_world_size(tmp_path):
    lengths = [101, 77, 130]
    make_shards(tmp_path, lengths)
    one = DataLoaderLite(B, T, 0, 1, "train", str(tmp_path), accum_steps=4)
    two = [DataLoaderLite(B, T, r, 2, "train", str(tmp_path), accum_steps=2) for r in range(2)]
    for _ in range(10):
        a = [one.next_batch()[0] for _ in range(4)]
        b = [two[r].next_batch()[0] for _ in range(2) for r in range(2)]  # chunk m * 2 + r
        assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a, b))


@pytest.mark.quick
def test_shards_are_memory_mapped(tmp_path):
    make_shards(tmp_path, [100])
    loader = DataLoaderLite(B, T, 0, 1, "train", str(tmp_path))
    assert isinstance(loader.tokens, np.memmap)


@pytest.mark.quick
def test_error_paths(tmp_path):
    with pytest.raises(UserError, match=r"data folder '.*nope' not found: run `python fineweb.py`"):
        DataLoaderLite(B, T, 0, 1, "train", str(tmp_path / "nope"))
    with pytest.raises(UserError, match=r"no train shard \(\*_train_\*\.npy\) in .*run `python fineweb.py`"):
        DataLoaderLite(B, T, 0, 1, "train", str(tmp_path))
    write_shards(tmp_path, "val", [np.arange(50)])  # a corpus smaller than one shard: a smaller --shard_size
    with pytest.raises(UserError, match=r"holds a val shard and no train shard: its corpus was smaller than "
                                        r"one --shard_size .* with a smaller --shard_size, about a tenth"):
        DataLoaderLite(B, T, 0, 1, "train", str(tmp_path))
    np.save(tmp_path / "x_train_000000.npy", np.arange(100, dtype=np.int32))
    with pytest.raises(UserError, match=r"x_train_000000\.npy: expected a 1-D uint16 array of token ids, "
                                        r"got int32"):
        DataLoaderLite(B, T, 0, 1, "train", str(tmp_path))
    np.save(tmp_path / "x_train_000000.npy", np.arange(100, dtype=np.uint16))
    write_shards(tmp_path, "train", [np.arange(16)], prefix="y")  # after x_: the short one (a remainder)
    assert DataLoaderLite(B, T, 0, 2, "train", str(tmp_path)).steps_per_epoch == 6  # a step: 16 + 1 tokens
    with pytest.raises(UserError, match=r"no train shard in .* holds one step of total_batch_size \+ 1 = 257 "
                                        r"tokens \(the longest, .*x_train_000000\.npy: 100 tokens\): lower "
                                        r"total_batch_size"):
        DataLoaderLite(B, T, 0, 2, "train", str(tmp_path), accum_steps=16)
    (tmp_path / "z_train_000000.npy").write_bytes(b"not numpy")
    with pytest.raises(UserError, match=r"z_train_000000\.npy: not a \.npy array of token ids as fineweb"):
        DataLoaderLite(B, T, 0, 1, "train", str(tmp_path))


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_shorter_than_a_step_are_passed_over(tmp_path, shuffle, capsys):
    """A shard too short for one step (fineweb.py's remainder; here two, in the middle) is passed
    over wherever its turn comes, keeping its place in the list: a checkpoint's shard number means
    the same file whatever total_batch_size, so a resume with a larger one finds its shard in the
    same order. Brute force: no step reads a short shard's tokens (ids 2000 and up here)."""
    from gptkit.tokenizer import EOT
    rng = np.random.default_rng(0)
    doc = lambda n, low: np.concatenate(([EOT], rng.integers(low, low + 1000, n - 1)))  # n tokens
    docs = lambda k: np.concatenate([doc(8, 0) for _ in range(k)])  # k documents of 8 tokens
    # shards of 72, 10, 56, 12 and 88 tokens
    write_shards(tmp_path, "train", [docs(9), doc(10, 2000), docs(7), doc(12, 2000), docs(11)])
    loader = DataLoaderLite(B, T, 0, 2, "train", str(tmp_path), shuffle=shuffle)  # steps of 16 tokens
    assert capsys.readouterr().out.count("fewer than one step of 17: passed over") == 2
    per_epoch = loader.steps_per_epoch
    assert per_epoch == 71 // 16 + 55 // 16 + 87 // 16  # the short ones hold none (each begins a document)
    begins, shards_read = [], set()
    for step in range(3 * per_epoch):  # three epochs, each in an order of its own when shuffled
        begins.append(loader.epoch_begins())
        shards_read.add(int(loader.order[loader.shard]))
        x, y = loader.next_batch()  # rank 0's chunk of the step
        assert bool(((x < 1000) | (x == EOT)).all()), (step, x)
    assert shards_read == {0, 2, 4} and [i for i, b in enumerate(begins) if b] == [per_epoch, 2 * per_epoch]
    for _ in range(per_epoch + 2):  # into epoch 3
        loader.next_batch()
    grown = DataLoaderLite(B, T, 0, 2, "train", str(tmp_path), accum_steps=2, shuffle=shuffle)  # 32 a step
    grown.load_state_dict(loader.state_dict())
    assert (grown.epoch, list(grown.order)) == (loader.epoch, list(loader.order))  # the same draw over all 5


@pytest.mark.quick
def test_unfinished_fineweb_output_is_refused(tmp_path):
    make_shards(tmp_path, [100, 100])
    (tmp_path / "fineweb_manifest.json").write_text('{"args": {}, "shards": [], "complete": false}')
    with pytest.raises(UserError, match=r"is unfinished: fineweb.py was interrupted or failed there; run the "
                                        r"same"):
        DataLoaderLite(B, T, 0, 1, "train", str(tmp_path))
    (tmp_path / "fineweb_manifest.json").write_text('{"args": {}, "shards": [], "complete": true}')
    DataLoaderLite(B, T, 0, 1, "train", str(tmp_path))


@pytest.mark.quick
def test_val_tokens_span_shards_and_errors(tmp_path):
    write_shards(tmp_path, "val", [np.arange(10), np.arange(100, 110)])
    assert load_val_tokens(str(tmp_path), 14).tolist() == list(range(10)) + list(range(100, 105))
    with pytest.raises(UserError, match=r"val split in .* has 20 tokens, fewer than val_tokens \+ 1 = 21"):
        load_val_tokens(str(tmp_path), 20)
    # issue 57.4: random bytes, which numpy takes for a pickle: what was expected, not numpy's advice
    bad = tmp_path / "edufineweb_val_000000.npy"
    bad.write_bytes(np.random.default_rng(0).bytes(1000))
    with pytest.raises(UserError) as e:
        load_val_tokens(str(tmp_path), 14)
    assert str(e.value) == f"{bad}: not a .npy array of token ids as fineweb.py writes them (not a .npy file)"


@pytest.mark.quick
def test_loader_state_resumes_any_world_size(tmp_path):
    """state_dict() after some steps on 2 ranks, load_state_dict() into 1 rank with double accumulation: the
    next global batches are the ones the uninterrupted 1-rank loader reads. A shard that is not the
    one the state names is refused."""
    make_shards(tmp_path, [5 * 16 + 3, 4 * 16 + 1, 3 * 16 + 7])
    two = [DataLoaderLite(B, T, r, 2, "train", str(tmp_path), accum_steps=1) for r in range(2)]
    one = DataLoaderLite(B, T, 0, 1, "train", str(tmp_path), accum_steps=2)
    for _ in range(6):  # into the second shard
        for loader in two:
            loader.next_batch()
        one.next_batch(), one.next_batch()
    state = {"epoch": 0, "shard": 1, "pos": 16, "shuffle": False, "seed": 1337,
             "file": "edufineweb_train_000001.npy"}
    assert two[0].state_dict() == two[1].state_dict() == one.state_dict() == state
    resumed = DataLoaderLite(B, T, 0, 1, "train", str(tmp_path), accum_steps=2)
    resumed.load_state_dict(two[0].state_dict())
    for _ in range(2 * 9):  # and around the wrap
        assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), one.next_batch()))
    with pytest.raises(UserError, match=r"the checkpoint was reading train shard 'other_train_000001.npy' "
                                        r"\(number 1\), but that shard of data_root is "
                                        r"'edufineweb_train_000001.npy'"):
        resumed.load_state_dict({"shard": 1, "pos": 16, "file": "other_train_000001.npy"})


@pytest.mark.quick
def test_token_ids_beyond_the_vocab_are_an_error(tmp_path):
    """A shard made with another tokenizer (an id >= vocab_size): one line naming the shard and the
    id when the shard is opened for reading, not an IndexError (or a CUDA assert) mid-step."""
    ok, bad = np.arange(200) % 500, np.arange(200) % 500
    bad[123] = 512
    write_shards(tmp_path, "train", [ok, bad])
    write_shards(tmp_path, "val", [bad])
    loader = DataLoaderLite(B, T, 0, 1, "train", str(tmp_path), vocab_size=512)  # shard 0 is fine
    with pytest.raises(UserError, match=r"edufineweb_train_000001.npy: token id 512 \(at token 123\) is not "
                                        r"below the model's vocab_size=512"):
        for _ in range(200 // (B * T)):  # on into shard 1
            loader.next_batch()
    DataLoaderLite(B, T, 0, 1, "train", str(tmp_path), vocab_size=513)  # a larger vocab takes it
    assert len(load_val_tokens(str(tmp_path), 100, vocab_size=512)) == 101  # the ids read are below it
    with pytest.raises(UserError, match=r"edufineweb_val_000000.npy: token id 512 \(at token 123\)"):
        load_val_tokens(str(tmp_path), 150, vocab_size=512)


def test_trainer_reports_an_id_beyond_the_vocab(tmp_path):
    """Through the trainer: the model's vocab_size (here 512) is what the shards are checked against."""
    from conftest import TINY, run_script
    write_shards(tmp_path / "data", "val", [np.arange(300) % 500])
    write_shards(tmp_path / "data", "train", [np.full(300, 600)])
    r = run_script([*TINY, "--vocab_size=512", "--B=2", "--T=16", "--total_batch_size=32",
                    f"--data_root={tmp_path / 'data'}", f"--log_dir={tmp_path / 'log'}", "--val_tokens=256"],
                   timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    shard = tmp_path / 'data' / 'edufineweb_train_000000.npy'
    assert f"error: {shard}: token id 600 (at token 0) is not below the model's vocab_size=512" in r.stderr

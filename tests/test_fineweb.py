import glob
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fineweb
from gptkit import shards
import commands
from conftest import ROOT, one_thread
from gptkit.shards import DataLoaderLite

WORDS = ("the a model token shard Python ünïcödé 数据 emoji🙂 code def class return "
         "42 3.14 \n\n").split(" ")


def make_docs(n, seed=0, max_words=400):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(1, max_words))) for _ in range(n)]


def expected_files(docs, shard_size, enc, max_tokens=0, prefix="local"):
    """build-nanogpt's output, computed the brute-force way: {name: bytes of np.save}; its names
    (prefix edufineweb) for FineWeb-Edu, "local" for local files."""
    stream = np.concatenate([np.array([50256] + enc.encode_ordinary(d), dtype=np.uint16) for d in docs])
    if max_tokens:
        stream = stream[:max_tokens]
    out = {}
    for i, start in enumerate(range(0, len(stream), shard_size)):
        f = io.BytesIO()
        np.save(f, stream[start:start + shard_size])
        out[f"{prefix}_{'val' if i == 0 else 'train'}_{i:06d}.npy"] = f.getvalue()
    return out


def shard_files(folder):
    return {os.path.basename(p): open(p, "rb").read() for p in glob.glob(os.path.join(folder, "*.npy"))}


def write_jsonl(path, docs, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, key: d}) + "\n")


def write_parquet(path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=7)


@pytest.mark.parametrize("num_proc", [1, 2])
def test_local_parquet_and_jsonl_shards(tmp_path, enc, num_proc):
    docs = make_docs(60)
    src = tmp_path / "src"
    os.makedirs(src / "sub")
    write_parquet(src / "a.parquet", docs[:25])  # sorted paths: a.parquet, b.jsonl, sub/c.txt
    write_jsonl(src / "b.jsonl", docs[25:59])
    (src / "sub" / "c.txt").write_text(docs[59], encoding="utf-8")
    out = tmp_path / "out"
    fineweb.main(["--dataset", str(src), "--out_dir", str(out), "--shard_size", "1000",
                  f"--num_proc={num_proc}"])
    want = expected_files(docs, 1000, enc)
    assert len(want) > 3 and shard_files(out) == want  # names, sizes, split, bytes
    assert len(np.load(out / "local_val_000000.npy")) == 1000 and shards.dataset_of(out) == "local files"
    # the trainer reads them
    loader = DataLoaderLite(2, 8, 0, 1, "train", str(out))
    x, y = loader.next_batch()
    assert x.flatten()[:5].tolist() == list(np.load(out / "local_train_000001.npy")[:5])


@pytest.mark.quick
def test_glob_max_tokens_and_a_document_longer_than_a_shard(tmp_path, enc):
    docs = make_docs(10, seed=1, max_words=3000)
    for i in range(2):
        write_jsonl(tmp_path / f"part{i}.jsonl", docs[5 * i:5 * i + 5], key="content")
    out = tmp_path / "out"
    fineweb.main(["--dataset", str(tmp_path / "part*.jsonl"), "--text_column", "content",
                  "--out_dir", str(out), "--shard_size", "300", "--max_tokens", "5000", "--num_proc=1"])
    assert shard_files(out) == expected_files(docs, 300, enc, max_tokens=5000)


def test_rerun_on_a_complete_folder_reuses_everything(tmp_path, capsys):
    write_jsonl(tmp_path / "d.jsonl", make_docs(20))
    args = ["--dataset", str(tmp_path / "d.jsonl"), "--out_dir", str(tmp_path / "out"), "--shard_size", "500",
            "--num_proc=1"]
    fineweb.main(args)
    before = shard_files(tmp_path / "out")
    capsys.readouterr()
    fineweb.main(args)
    assert "complete already: reused all" in capsys.readouterr().out
    assert shard_files(tmp_path / "out") == before


def interrupted(monkeypatch, argv, at, torn=False):
    """fineweb.main(argv) stopped by Ctrl-C at its at-th atomic write (see below); torn: with the
    half-written temporary file a kill would leave beside it."""
    real, calls = fineweb.atomic_write, []

    def interrupting(path, write):
        calls.append(path)
        if len(calls) == at:
            if torn:
                with open(f"{path}.tmp123", "wb") as f:
                    f.write(b"half")
            raise KeyboardInterrupt
        real(path, write)
    monkeypatch.setattr(fineweb, "atomic_write", interrupting)
    with pytest.raises(SystemExit, match="interrupted: finished shards are kept; run the same command again"):
        fineweb.main(argv)
    monkeypatch.setattr(fineweb, "atomic_write", real)


# the writes: 1 the empty manifest; then per shard k: 2k the shard, 2k+1 the manifest recording it;
# last the manifest marked complete. Negative: counted from the end (the final shard and 'complete').
@pytest.mark.quick
@pytest.mark.parametrize("crash_at", [1, 2, 3, 4, 5, 7, -3, -2, -1])
@pytest.mark.parametrize("max_tokens", [0, 9000])
def test_interrupted_then_rerun_is_byte_identical(tmp_path, monkeypatch, capsys, enc, crash_at, max_tokens):
    """Ctrl-C at one atomic write (a shard, or the manifest that records it); then the same
    command again finishes with exactly the uninterrupted bytes."""
    docs = make_docs(40, seed=2)
    write_jsonl(tmp_path / "d.jsonl", docs)
    args = ["--dataset", str(tmp_path / "d.jsonl"), "--out_dir", str(tmp_path / "out"), "--shard_size", "700",
            "--num_proc=1", f"--max_tokens={max_tokens}"]
    want = expected_files(docs, 700, enc, max_tokens)
    n_writes = 2 + 2 * len(want)
    crash_at = crash_at if crash_at > 0 else n_writes + 1 + crash_at
    interrupted(monkeypatch, args, crash_at, torn=True)
    capsys.readouterr()
    fineweb.main(args)
    out = capsys.readouterr().out
    if crash_at > 3:
        assert "resuming: reused" in out
    assert shard_files(tmp_path / "out") == want
    assert not glob.glob(str(tmp_path / "out" / "*.tmp*"))


def test_a_folder_begun_with_older_names_keeps_them(tmp_path, monkeypatch, enc):
    """A folder an older fineweb.py began (every shard named edufineweb_, whatever the data), resumed:
    its new shards take the names it began with, so the trainer reads one consistent set."""
    docs = make_docs(40, seed=2)
    write_jsonl(tmp_path / "d.jsonl", docs)
    args = ["--dataset", str(tmp_path / "d.jsonl"), "--out_dir", str(tmp_path / "out"), "--shard_size", "700",
            "--num_proc=1"]
    interrupted(monkeypatch, args, 8)  # at the 4th shard
    manifest = json.loads((tmp_path / "out" / shards.MANIFEST).read_text())
    for shard in manifest["shards"]:  # as the older version named them
        old = shard["file"].replace("local_", "edufineweb_")
        os.rename(tmp_path / "out" / shard["file"], tmp_path / "out" / old)
        shard["file"] = old
    (tmp_path / "out" / shards.MANIFEST).write_text(json.dumps(manifest))
    fineweb.main(args)
    want = expected_files(docs, 700, enc, prefix="edufineweb")
    assert len(manifest["shards"]) == 3 and shard_files(tmp_path / "out") == want


def test_kill_9_then_rerun_is_byte_identical(tmp_path):
    """A real kill -9 of a running fineweb.py, then the same command: the uninterrupted bytes."""
    rng = np.random.default_rng(3)
    with open(tmp_path / "big.jsonl", "w") as f:
        for i in range(4000):
            f.write(json.dumps({"text": " ".join(map(str, rng.integers(0, 10 ** 6, 1500)))}) + "\n")
    cmd = [sys.executable, "fineweb.py", "--dataset", str(tmp_path / "big.jsonl"), "--shard_size", "100000",
           "--num_proc=1"]
    ref = commands.run(cmd + ["--out_dir", str(tmp_path / "ref")], cwd=ROOT, capture_output=True, text=True,
                     env=one_thread())
    assert ref.returncode == 0, ref.stderr
    n_shards = len(shard_files(tmp_path / "ref"))
    out = tmp_path / "out"
    proc = commands.Popen(cmd + ["--out_dir", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, env=one_thread())
    manifest = out / fineweb.MANIFEST
    deadline = time.time() + 60
    while time.time() < deadline:  # kill once two shards are recorded
        try:
            if len(json.loads(manifest.read_text())["shards"]) >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = json.loads(manifest.read_text())
    assert not state["complete"] and len(state["shards"]) < n_shards  # it really was cut short
    again = commands.run(cmd + ["--out_dir", str(out)], cwd=ROOT, capture_output=True, text=True,
                       env=one_thread())
    assert again.returncode == 0, again.stderr
    assert "resuming: reused" in again.stdout
    assert shard_files(out) == shard_files(tmp_path / "ref")


def run_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        fineweb.main(argv + ["--num_proc=1"])
    assert e.value.code != 0
    return str(e.value.code)


@pytest.mark.quick
def test_error_paths(tmp_path, capsys):
    out = tmp_path / "out"
    msg = run_error(["--dataset", str(tmp_path / "missing.jsonl"), "--out_dir", str(out)], capsys)
    assert msg == f"error: --dataset '{tmp_path / 'missing.jsonl'}': no such file or folder"
    (tmp_path / "empty.jsonl").write_text("")
    msg = run_error(["--dataset", str(tmp_path / "empty.jsonl"), "--out_dir", str(out)], capsys)
    assert msg == f"error: {tmp_path / 'empty.jsonl'}: no documents"
    write_jsonl(tmp_path / "k.jsonl", ["x"], key="body")
    msg = run_error(["--dataset", str(tmp_path / "k.jsonl"), "--out_dir", str(out)], capsys)
    assert msg == f"error: {tmp_path / 'k.jsonl'}:1: no key 'text'; keys: id, body (choose one with " \
                  "--text_column)"
    write_parquet(tmp_path / "p.parquet", ["x"])
    msg = run_error(["--dataset", str(tmp_path / "p.parquet"), "--text_column", "body",
                     "--out_dir", str(out)], capsys)
    assert msg == f"error: {tmp_path / 'p.parquet'}: no column 'body'; columns: id, text (choose one with " \
                  "--text_column)"
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe not utf-8")
    msg = run_error(["--dataset", str(tmp_path / "bad.txt"), "--out_dir", str(out)], capsys)
    assert msg == f"error: {tmp_path / 'bad.txt'}: not valid UTF-8 (byte 3)"
    (tmp_path / "j.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    msg = run_error(["--dataset", str(tmp_path / "j.jsonl"), "--out_dir", str(out)], capsys)
    assert msg.startswith(f"error: {tmp_path / 'j.jsonl'}:2: not valid JSON")
    assert not out.exists() or not glob.glob(str(out / "*.npy"))  # the good first document wrote no shard
    (tmp_path / "j.jsonl").write_text('{"text": "fine"}\n{"text": "mended"}\n')  # fixed: a rerun goes through
    fineweb.main(["--dataset", str(tmp_path / "j.jsonl"), "--out_dir", str(out), "--num_proc=1"])
    both = len(fineweb.tokenize("fine")) + len(fineweb.tokenize("mended"))  # each with its <|endoftext|>
    assert len(np.load(out / "local_val_000000.npy")) == both
    folder = tmp_path / "two_parquets"
    os.makedirs(folder)
    write_parquet(folder / "a.parquet", make_docs(50))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x"]}), folder / "b.parquet")
    msg = run_error(["--dataset", str(folder), "--out_dir", str(tmp_path / "o2"), "--shard_size", "100"],
                    capsys)
    assert msg == f"error: {folder / 'b.parquet'}: no column 'text'; columns: body (choose one with " \
                  "--text_column)"
    assert not (tmp_path / "o2").exists()  # checked before the first shard of a.parquet
    (tmp_path / "x.csv").write_text("a,b\n")
    msg = run_error(["--dataset", str(tmp_path / "x.csv"), "--out_dir", str(tmp_path / "o3")], capsys)
    assert "x.csv: unsupported file type" in msg
    msg = run_error(["--dataset", "no_such_folder/", "--out_dir", str(tmp_path / "o3")], capsys)
    assert msg.startswith("error: --dataset 'no_such_folder/' is no local file, folder or glob, and loading "
                          "it from the HF hub failed")


def test_refuses_a_folder_of_other_shards(tmp_path, capsys):
    write_jsonl(tmp_path / "d.jsonl", make_docs(20))
    out = tmp_path / "out"
    fineweb.main(["--dataset", str(tmp_path / "d.jsonl"), "--out_dir", str(out), "--shard_size", "500",
                  "--num_proc=1"])
    before = shard_files(out)
    msg = run_error(["--dataset", str(tmp_path / "d.jsonl"), "--out_dir", str(out), "--shard_size", "600"],
                    capsys)
    assert f"error: {out} holds shards made with other arguments (shard_size: 500 there, 600 now)" in msg
    assert "delete the folder or choose another --out_dir" in msg
    assert shard_files(out) == before
    foreign = tmp_path / "foreign"
    os.makedirs(foreign)
    np.save(foreign / "edufineweb_train_000001.npy", np.arange(10, dtype=np.uint16))
    msg = run_error(["--dataset", str(tmp_path / "d.jsonl"), "--out_dir", str(foreign)], capsys)
    assert "already holds .npy shards that this script did not record" in msg
    assert len(os.listdir(foreign)) == 1


def test_hf_dataset_path(tmp_path, monkeypatch, enc):
    """The HF branch, with datasets.load_dataset answering from memory (no network here)."""
    import datasets
    docs = make_docs(30, seed=4)
    asked = []

    def fake_load_dataset(path, name=None, split=None, streaming=False):
        asked.append((path, name, split, streaming))
        ds = datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))})
        return ds.to_iterable_dataset() if streaming else ds
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    fineweb.main(["--out_dir", str(tmp_path / "a"), "--shard_size", "800", "--num_proc=1", "--streaming"])
    assert asked == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)]
    # build-nanogpt's names; the dataset as run.json records it
    assert shard_files(tmp_path / "a") == expected_files(docs, 800, enc, prefix="edufineweb")
    assert shards.dataset_of(tmp_path / "a") == "HuggingFaceFW/fineweb-edu sample-10BT"
    fineweb.main(["--dataset", "HuggingFaceFW/fineweb", "--out_dir", str(tmp_path / "f"),  # names of its own
                  "--shard_size", "800", "--num_proc=1", "--streaming"])
    assert shard_files(tmp_path / "f") == expected_files(docs, 800, enc, prefix="fineweb")
    # not streaming, interrupted after 3 shards, resumed through Dataset.skip
    interrupted(monkeypatch, ["--out_dir", str(tmp_path / "c"), "--shard_size", "800", "--num_proc=1"],
                8)  # at the 4th shard
    fineweb.main(["--out_dir", str(tmp_path / "c"), "--shard_size", "800", "--num_proc=1"])
    assert shard_files(tmp_path / "c") == expected_files(docs, 800, enc, prefix="edufineweb")
    with pytest.raises(SystemExit, match="HuggingFaceFW/fineweb-edu: no column 'body'; columns: text, id"):
        fineweb.main(["--out_dir", str(tmp_path / "b"), "--text_column", "body", "--num_proc=1"])


def demo_digest():
    import hashlib
    h = hashlib.sha256()
    for doc in fineweb.iter_demo():
        h.update(doc.encode() + b"\0")
    return h.hexdigest()


def test_demo_corpus_is_deterministic(tmp_path, enc):
    # the same documents under pytest (sys.stdout replaced) as in a plain subprocess
    code = "import sys; sys.path.insert(0, 'tests'); import test_fineweb; print(test_fineweb.demo_digest())"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == demo_digest()
    first = list(fineweb.iter_demo())
    assert len(first) > 500 and any("def " in d for d in first)
    for n in (1, 2):
        r = commands.run([sys.executable, "fineweb.py", "--demo", "--out_dir", str(tmp_path / f"d{n}")],
                       cwd=ROOT, capture_output=True, text=True, env=one_thread())
        assert r.returncode == 0, r.stderr
    a, b = shard_files(tmp_path / "d1"), shard_files(tmp_path / "d2")
    assert a == b and len(a) > 5 and shards.dataset_of(tmp_path / "d1") == "demo: the Python standard library"
    total = sum(len(np.load(tmp_path / "d1" / name)) for name in a)
    assert 2_000_000 < total < 20_000_000  # a few million tokens
    assert np.load(tmp_path / "d1" / "demo_train_000003.npy")[:10].tolist() == \
        np.concatenate([[50256] + enc.encode_ordinary(d) for d in first])[1_500_000:1_500_010].tolist()


def test_works_with_spawn(tmp_path, enc):
    """macOS/Windows start workers with spawn: they import fineweb, which does no work at import."""
    docs = make_docs(30, seed=5)
    write_jsonl(tmp_path / "d.jsonl", docs)
    code = ("import multiprocessing as mp, fineweb\n"
            "if __name__ == '__main__':\n"
            "    mp.set_start_method('spawn')\n"
            f"    fineweb.main(['--dataset', {str(tmp_path / 'd.jsonl')!r},"
            f" '--out_dir', {str(tmp_path / 'out')!r}, '--shard_size', '900', '--num_proc', '2'])\n")
    (tmp_path / "spawn_main.py").write_text(code)
    r = subprocess.run([sys.executable, str(tmp_path / "spawn_main.py")], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert shard_files(tmp_path / "out") == expected_files(docs, 900, enc)

"""The layout's promises, checked on the code as text (issues 19 and 35): the root holds what a
user runs (and the model), gptkit/ the machinery it imports; functions take few arguments; the
pieces of train_gpt2.py that other files import read none of its constants; collectives live in
gptkit/parallel.py (and the trainer's own, in the open); one user-error class; GPT-2's vocabulary
size written once."""
import ast
import glob
import inspect
import os
import re

import torch
import torch.distributed as dist
import torch.distributed.fsdp
import torch.distributed.launcher.api

import train_gpt2
from conftest import ROOT

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "*.py")))  # what a user runs, and model.py
PACKAGE = sorted(glob.glob(os.path.join(ROOT, "gptkit", "*.py")))
PROJECT = SCRIPTS + PACKAGE  # tests aside
IMPORTED = ("setup_device", "DataLoaderLite", "evaluate", "train_step")  # by bench, gpu_check, tests


def name(path):
    """path as the project names it: train_gpt2.py, gptkit/parallel.py."""
    return os.path.relpath(path, ROOT)


def tree(path):
    with open(path) as f:
        return ast.parse(f.read())


def functions(path):
    return [n for n in ast.walk(tree(path)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def runs_as_a_script(path):
    """Whether path has its `if __name__ == '__main__':`."""
    tests = [ast.unparse(n.test) for n in tree(path).body if isinstance(n, ast.If)]
    return "__name__ == '__main__'" in tests


def imported(path):
    """The modules path imports, by their first name: torch, gptkit, model, ..."""
    for n in ast.walk(tree(path)):
        if isinstance(n, ast.Import):
            yield from (a.name.split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            yield n.module.split(".")[0]


def test_the_root_holds_what_a_user_runs_and_gptkit_what_it_imports():
    """Every script at the root runs as `python script.py` (model.py aside: the model, as in
    nanoGPT), no module of gptkit/ does, and gptkit/ imports no script but model.py."""
    assert {name(p) for p in PROJECT if runs_as_a_script(p)} == {name(p) for p in SCRIPTS} - {"model.py"}
    scripts = {os.path.basename(p)[:-len(".py")] for p in SCRIPTS} - {"model"}
    found = [f"{name(p)} imports {m}" for p in PACKAGE for m in imported(p) if m in scripts]
    assert not found, found


def test_no_function_needs_more_than_six_arguments():
    crowded = []
    for path in PROJECT:
        for f in functions(path):
            args = f.args.posonlyargs + f.args.args
            skip = 1 if args and args[0].arg in ("self", "cls") else 0
            required = len(args) - skip - len(f.args.defaults) + sum(d is None for d in f.args.kw_defaults)
            total = len(args) - skip + len(f.args.kwonlyargs)
            if required > 6 or total > 10:
                crowded.append(f"{name(path)}:{f.lineno} {f.name} ({required} required, {total} in all)")
    assert not crowded, crowded


def test_what_other_files_import_from_the_trainer_reads_no_constant():
    top = {n.name: n for n in tree(os.path.join(ROOT, "train_gpt2.py")).body
           if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    constants = set(train_gpt2.DEFAULTS) | {"rank", "world", "config"}
    readers = {}
    for piece in IMPORTED:
        nodes = list(ast.walk(top[piece]))
        params = {a.arg for f in nodes if isinstance(f, (ast.FunctionDef, ast.Lambda))
                  for a in f.args.args + f.args.kwonlyargs}
        names = [n for n in nodes if isinstance(n, ast.Name)]
        stored = {n.id for n in names if isinstance(n.ctx, ast.Store)}
        loaded = {n.id for n in names if isinstance(n.ctx, ast.Load)}
        read = sorted((loaded - params - stored) & constants)
        if read:
            readers[piece] = read
    assert not readers, readers


def test_collectives_only_in_parallel_and_the_trainer():
    names = r"all_reduce|all_gather\w*|broadcast\w*|barrier|reduce_scatter\w*|gather|scatter|send|recv"
    collective = re.compile(rf"\bdist\.({names})\(|\.full_tensor\(")
    found = [f"{name(p)}:{i}" for p in PROJECT if name(p) not in ("gptkit/parallel.py", "train_gpt2.py")
             for i, line in enumerate(open(p), 1) if collective.search(line)]
    assert not found, found


def test_one_user_error_class_and_one_home_for_the_vocabulary_size():
    classes = [f"{name(p)}:{c.name}" for p in PROJECT for c in ast.walk(tree(p))
               if isinstance(c, ast.ClassDef) and c.name.endswith("Error")]
    assert classes == ["gptkit/common.py:UserError"]
    assert len([p for p in PROJECT if re.search(r"5025[67]", open(p).read())]) <= 2


# Issue 37.3: what the project relies on from torch, a release that has it, and a check that the
# installed torch has it. The releases were read in the wheels of torch 2.9.0, 2.10.0, 2.11.0 and
# 2.12.0 (2026-12-02): all four have the first three, only 2.12.0 the last. requirements.txt's
# floor is the newest of them: on an older torch a documented feature would silently not work.
STORE = ("_get_default_store", "_set_pg_timeout")
TORCH_FLOOR = [
    ("torch.optim.Muon with adjust_lr_fn (optimizer='muon')", (2, 9), lambda: torch.optim.Muon),
    ("FSDP2's fully_shard, public (parallel='fsdp')", (2, 9), lambda: torch.distributed.fsdp.fully_shard),
    ("the process group's store and timeout (parallel.wait_for_all, hold_to)", (2, 9),
     lambda: all(hasattr(dist.distributed_c10d, f) for f in STORE) and dist.DistStoreError),
    ("torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT (scripts/slurm_train.sh; pytorch PR #172596)", (2, 12),
     lambda: "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in inspect.getsource(torch.distributed.launcher.api)),
]


def test_requirements_torch_floor_is_the_newest_feature_the_project_uses():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        floor = re.search(r"^torch>=(\d+)\.(\d+)", f.read(), re.M).groups()
    assert tuple(map(int, floor)) == max(since for _, since, _ in TORCH_FLOOR)
    missing = [what for what, _, has in TORCH_FLOOR if not has()]
    assert not missing, f"torch {torch.__version__} lacks {missing}"

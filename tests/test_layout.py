"""The layout's promises, checked on the code as text (issues 19, 35 and 42): the root holds what a
user runs (and the model), gptkit/ the machinery it imports; train_gpt2.py is one flat script, as
nanoGPT's train.py (no module state rebound by `global`, no main), which nothing imports; no import
cycle between the project's modules; collectives live in gptkit/distributed.py and gptkit/fsdp.py
(and the trainer's own, in the open); one user-error class; GPT-2's vocabulary size written once.
How many helpers or arguments a function has, and how long it is, are for review, not tests."""
import ast
import glob
import inspect
import os
import re

import torch
import torch.distributed as dist
import torch.distributed.fsdp
import torch.distributed.launcher.api

import pytest

from conftest import ROOT

pytestmark = pytest.mark.quick  # every test here: the edit loop's tier

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "*.py")))  # what a user runs, and model.py
PACKAGE = sorted(glob.glob(os.path.join(ROOT, "gptkit", "*.py")))
PROJECT = SCRIPTS + PACKAGE  # tests aside
TESTS = sorted(glob.glob(os.path.join(ROOT, "tests", "*.py")))


def name(path):
    """path as the project names it: train_gpt2.py, gptkit/distributed.py."""
    return os.path.relpath(path, ROOT)


def tree(path):
    with open(path) as f:
        return ast.parse(f.read())


def functions(path):
    return [n for n in ast.walk(tree(path)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def runs_as_a_script(path):
    """Whether path does something when python runs it: its `if __name__ == '__main__':`, or, in a
    flat script (train_gpt2.py, as nanoGPT's train.py), calls at its top level."""
    body = tree(path).body
    tests = [ast.unparse(n.test) for n in body if isinstance(n, ast.If)]
    calls = [n for n in body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    return "__name__ == '__main__'" in tests or bool(calls)


def imported(path):
    """The modules path imports, by their first name: torch, gptkit, model, ..."""
    for n in ast.walk(tree(path)):
        if isinstance(n, ast.Import):
            yield from (a.name.split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            yield n.module.split(".")[0]


def test_the_root_holds_what_a_user_runs_and_gptkit_what_it_imports():
    """Every script at the root runs as `python script.py` (model.py aside: the model, as in
    nanoGPT), no module of gptkit/ does, and gptkit/ imports no script but model.py. Nothing
    imports train_gpt2.py, not even a test (issue 42): importing the flat script runs a training."""
    assert {name(p) for p in PROJECT if runs_as_a_script(p)} == {name(p) for p in SCRIPTS} - {"model.py"}
    scripts = {os.path.basename(p)[:-len(".py")] for p in SCRIPTS} - {"model"}
    found = [f"{name(p)} imports {m}" for p in PACKAGE for m in imported(p) if m in scripts]
    assert not found, found
    found = [f"{name(p)} imports it" for p in PROJECT + TESTS for m in imported(p) if m == "train_gpt2"]
    assert not found, found


def test_the_trainer_is_one_flat_script():
    """Issue 42: train_gpt2.py is read top to bottom, as nanoGPT's train.py: the run itself at the top
    level, no main, and no `global` statement: no helper rebinds the run's module state behind the
    reader's back. Helpers it may have, as many as a change needs (an EMA of the weights, say)."""
    trainer = os.path.join(ROOT, "train_gpt2.py")
    assert not [n.lineno for n in ast.walk(tree(trainer)) if isinstance(n, ast.Global)]
    assert "main" not in {f.name for f in functions(trainer)}


def module_name(path):
    """path as Python imports it: train_gpt2, gptkit.distributed."""
    return name(path)[:-len(".py")].replace(os.sep, ".")


def project_imports(path, modules):
    """The project's modules (of modules) that path imports, anywhere in it (inside functions too)."""
    found = set()
    for n in ast.walk(tree(path)):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):  # from . import x (relative): from path's package
            base = ".".join(module_name(path).split(".")[:-n.level] + [n.module or ""]).strip(".")
            base = base if n.level else n.module
            found |= {base} | {f"{base}.{a.name}" for a in n.names}  # from gptkit import run: a module
    return found & modules


def find_cycle(graph):
    """A cycle of graph ({module: modules it imports}) as [a, b, ..., a], or None."""
    done, path = set(), []

    def visit(m):
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if cycle := visit(n):
                return cycle
        path.pop()
        done.add(m)
        return None

    for m in sorted(graph):
        if cycle := visit(m):
            return cycle
    return None


def test_no_import_cycle():
    """Issue 42: no module of the project imports, directly or through others, one that imports it
    back, counting the imports inside functions (a cycle there only waits for the call to bite)."""
    modules = {module_name(p) for p in PROJECT}
    graph = {module_name(p): project_imports(p, modules) - {module_name(p)} for p in PROJECT}
    # the walk sees what it must: top-level and in-function imports, `from gptkit import x` as module x
    assert {"gptkit.checkpoint", "model"} <= graph["train_gpt2"], graph["train_gpt2"]
    assert {"gptkit.distributed", "gptkit.memory"} <= graph["gptkit.run"], graph["gptkit.run"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_collectives_only_in_parallel_fsdp_and_the_trainer():
    names = r"all_reduce|all_gather\w*|broadcast\w*|barrier|reduce_scatter\w*|gather|scatter|send|recv"
    # a call, or a reference (dist.all_reduce passed on), by any of the names torch.distributed goes by
    collective = re.compile(rf"\b(dist|torch\.distributed|c10d)\.({names})\b|\.full_tensor\(|"
                            rf"^\s*from torch\.distributed(\.distributed_c10d)? import .*\b({names})\b")
    allowed = ("gptkit/distributed.py", "gptkit/fsdp.py", "train_gpt2.py")
    found = [f"{name(p)}:{i}" for p in PROJECT if name(p) not in allowed
             for i, line in enumerate(open(p), 1) if collective.search(line)]
    assert not found, found


def test_one_user_error_class_and_one_home_for_the_vocabulary_size():
    classes = [f"{name(p)}:{c.name}" for p in PROJECT for c in ast.walk(tree(p))
               if isinstance(c, ast.ClassDef) and c.name.endswith("Error")]
    assert classes == ["gptkit/common.py:UserError"]
    assert [name(p) for p in PROJECT if re.search(r"5025[67]", open(p).read())] == ["gptkit/tokenizer.py"]


# Issue 37.3: what the project relies on from torch, a release that has it, and a check that the
# installed torch has it. The releases were read in the wheels of torch 2.9.0, 2.10.0, 2.11.0 and
# 2.12.0 (2026-12-02): all four have the first three, only 2.12.0 the last. requirements.txt's
# floor is the newest of them: on an older torch a documented feature would silently not work.
STORE = ("_get_default_store", "_set_pg_timeout")
TORCH_FLOOR = [
    ("torch.optim.Muon with adjust_lr_fn (optimizer='muon')", (2, 9),
     lambda: "adjust_lr_fn" in inspect.signature(torch.optim.Muon).parameters),
    ("FSDP2's fully_shard, public (parallel='fsdp')", (2, 9), lambda: torch.distributed.fsdp.fully_shard),
    ("the process group's store and timeout (distributed.wait_for_all, set_collective_timeout)", (2, 9),
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

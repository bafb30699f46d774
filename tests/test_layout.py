"""The layout's promises, checked on the code as text (issue 19): functions take few arguments;
the pieces of train_gpt2.py that other files import read none of its constants; collectives live
in gptkit/parallel.py (and the trainer's own, in the open); one user-error class; GPT-2's vocabulary
size written once."""
import ast
import glob
import os
import re

import train_gpt2
from conftest import ROOT

PROJECT = sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "gptkit", "*.py")))  # tests aside
IMPORTED = ("setup_device", "DataLoaderLite", "evaluate", "train_step")  # by bench, gpu_check, tests


def functions(path):
    return [n for n in ast.walk(ast.parse(open(path).read())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_needs_more_than_six_arguments():
    crowded = []
    for path in PROJECT:
        for f in functions(path):
            args = f.args.posonlyargs + f.args.args
            skip = 1 if args and args[0].arg in ("self", "cls") else 0
            required = len(args) - skip - len(f.args.defaults) + sum(d is None for d in f.args.kw_defaults)
            total = len(args) - skip + len(f.args.kwonlyargs)
            if required > 6 or total > 10:
                crowded.append(f"{os.path.basename(path)}:{f.lineno} {f.name} ({required} required, {total} in all)")
    assert not crowded, crowded


def test_what_other_files_import_from_the_trainer_reads_no_constant():
    tree = ast.parse(open(os.path.join(ROOT, "train_gpt2.py")).read())
    top = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    readers = {}
    for name in IMPORTED:
        params = {a.arg for f in ast.walk(top[name]) if isinstance(f, (ast.FunctionDef, ast.Lambda))
                  for a in f.args.args + f.args.kwonlyargs}
        stored = {n.id for n in ast.walk(top[name]) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        loaded = {n.id for n in ast.walk(top[name]) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        read = sorted((loaded - params - stored) & (set(train_gpt2.DEFAULTS) | {"rank", "world", "config"}))
        if read:
            readers[name] = read
    assert not readers, readers


def test_collectives_only_in_parallel_and_the_trainer():
    collective = re.compile(r"\bdist\.(all_reduce|all_gather\w*|broadcast\w*|barrier|reduce_scatter\w*|gather|scatter|"
                            r"send|recv)\(|\.full_tensor\(")
    found = [f"{os.path.basename(p)}:{i}" for p in PROJECT if os.path.basename(p) not in ("parallel.py", "train_gpt2.py")
             for i, line in enumerate(open(p), 1) if collective.search(line)]
    assert not found, found


def test_one_user_error_class_and_one_home_for_the_vocabulary_size():
    classes = [f"{os.path.basename(p)}:{c.name}" for p in PROJECT for c in ast.walk(ast.parse(open(p).read()))
               if isinstance(c, ast.ClassDef) and c.name.endswith("Error")]
    assert classes == ["common.py:UserError"]
    assert len([p for p in PROJECT if re.search(r"5025[67]", open(p).read())]) <= 2

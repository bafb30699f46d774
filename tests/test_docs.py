"""The docs point at the code as `file.py:name`; every such reference must name something that
file defines, so that the guides cannot drift from the code."""
import ast
import glob
import os
import re

from conftest import ROOT

REF = re.compile(r"`([A-Za-z_][\w/]*\.py):([A-Za-z_][\w.]*)`")


def defines(path, dotted):
    """Whether the Python file at path defines dotted at its top level (a function, class or
    assigned constant), or, for Class.member, in that class's body."""
    if not os.path.isfile(path):
        return False
    scope = ast.parse(open(path).read()).body
    for part in dotted.split('.'):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def references(text):
    return REF.findall(text)


def test_resolver_tells_real_names_from_stale_ones():
    trainer = os.path.join(ROOT, "train_gpt2.py")
    assert defines(trainer, "train_step") and defines(trainer, "total_batch_size")
    assert defines(trainer, "DataLoaderLite") and defines(trainer, "DataLoaderLite.next_batch")
    assert not defines(trainer, "no_such_function") and not defines(trainer, "DataLoaderLite.no_such_method")
    assert not defines(trainer, "train_step.x")  # a function has no members here
    assert not defines(os.path.join(ROOT, "no_such_file.py"), "main")
    assert references("see `model.py:GPT.forward` and `a/b.py:c`, not file.py:x") == [("model.py", "GPT.forward"),
                                                                                     ("a/b.py", "c")]


def test_every_code_reference_in_docs_resolves():
    stale = []
    for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        for file, name in references(open(doc).read()):
            if not defines(os.path.join(ROOT, file), name):
                stale.append(f"{os.path.relpath(doc, ROOT)}: {file}:{name}")
    assert not stale, "references to code that does not exist:\n" + "\n".join(stale)


def test_ddp_guide_points_at_the_code():
    refs = set(references(open(os.path.join(ROOT, "docs", "ddp.md")).read()))
    assert len(refs) >= 15, sorted(refs)


def test_config_files_are_said_to_run_as_code():
    """Issue 21.8: a config file is Python that the trainer executes: the README and configurator.py
    say so, and to use only files you trust."""
    for path in ("README.md", "configurator.py"):
        text = " ".join(open(os.path.join(ROOT, path)).read().split())
        assert "runs as code: use only files you trust" in text, path

"""The layers hold (issue 46): `lint-imports` keeps `.importlinter`'s contract (core < config < diffusion < models <
data < train, inference < serve < commands, function-local imports included), and no module or package of vidray
imports one that imports it back, directly or through others (a cycle a layers contract does not see: siblings of
one layer, modules of one package). Before issue 46 there were 4 module cycles and 5 package cycles."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import networkx as nx

REPO = Path(__file__).resolve().parents[2]


def _graph(package: str = "vidray") -> nx.DiGraph:
    """`package`'s import graph, one edge per module that imports another (grimp: every import statement, in
    functions too)."""
    imports = grimp.build_graph(package, include_external_packages=False)
    graph = nx.DiGraph()
    for module in imports.modules:
        graph.add_node(module)
        graph.add_edges_from((module, target) for target in imports.find_modules_directly_imported_by(module))
    return graph


def _cycles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def test_lint_imports_keeps_the_layers_contract():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    done = subprocess.run([lint, "--config", str(REPO / ".importlinter")], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_no_module_imports_one_that_imports_it_back():
    assert _cycles(_graph()) == []


def test_no_package_imports_one_that_imports_it_back():
    def package(module: str) -> str:  # vidray.data.shards -> vidray.data; vidray.config -> vidray.config
        return ".".join(module.split(".")[:2])

    packages = nx.DiGraph()
    for source, target in _graph().edges:
        if package(source) != package(target):
            packages.add_edge(package(source), package(target))
    assert _cycles(packages) == []


def test_the_cycle_check_sees_an_import_back_inside_a_function(tmp_path, monkeypatch):
    """The checks above can fail: a package whose `b` imports `a` inside a function, as vidray's cycles were held
    apart, is a cycle."""
    (tmp_path / "cyclic").mkdir()
    (tmp_path / "cyclic" / "__init__.py").write_text("")
    (tmp_path / "cyclic" / "a.py").write_text("from cyclic import b\n")
    (tmp_path / "cyclic" / "b.py").write_text("def f():\n    from cyclic import a\n    return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(_graph("cyclic")) == [["cyclic.a", "cyclic.b"]]


# What a function-local import's comment starts with (docs/architecture.md, Layers): why it is not at the top.
LOCAL_IMPORT_TAGS = ("heavy:", "optional:", "lazy:", "cycle:")


def _untagged_local_imports(root: Path) -> list[str]:
    """`path:line  statement` for each import inside a function under `root` whose first line carries no comment
    starting with one of LOCAL_IMPORT_TAGS."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        local = {node.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
        for lineno in sorted(local):
            line = lines[lineno - 1]
            comment = line.split("#", 1)[1].strip() if "#" in line else ""
            if not comment.startswith(LOCAL_IMPORT_TAGS):
                found.append(f"{path.relative_to(root.parent)}:{lineno}  {line.strip()}")
    return found


def test_every_function_local_import_says_why():
    """An import inside a function says why it is not at the module's top, on its (first) line: `# heavy: torch`
    (importing it loads packages the module does not load), `# optional: ...` (a dependency that may be missing),
    `# lazy: ...` (looked up at call time for another reason: a test patches it, a class pickled by value), or
    `# cycle: ...`. Any other import moves to the top."""
    untagged = _untagged_local_imports(REPO / "vidray")
    assert not untagged, (f"{len(untagged)} function-local import(s) without a `# heavy:`/`# optional:`/`# lazy:`/"
                          "`# cycle:` comment: move each to the module's top, or say why it stays:\n" + "\n".join(untagged))


def test_the_local_import_check_sees_an_untagged_import(tmp_path):
    """The check above can fail: a function-local import without a tag (or with a comment that is not one) is
    reported; a tagged one, a multi-line one tagged on its first line and a top-level one are not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import json\n\n\ndef f():\n    import torch  # heavy: torch\n    from ray import (  # heavy: ray\n"
        "        get,\n        put,\n    )\n    import csv\n    import yaml  # the config reader\n    return json\n")
    assert _untagged_local_imports(tmp_path / "pkg") == ["pkg/m.py:10  import csv",
                                                         "pkg/m.py:11  import yaml  # the config reader"]


def test_the_docs_name_the_local_import_tags():
    layers = (REPO / "docs" / "architecture.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    assert all(f"`# {tag}" in layers for tag in LOCAL_IMPORT_TAGS), layers

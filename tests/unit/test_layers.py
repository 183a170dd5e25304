"""The layers hold (issue 46): `lint-imports` keeps `.importlinter`'s contract (core < config < diffusion < models <
data < train, inference < serve < commands, function-local imports included), and no module or package of vidray
imports one that imports it back, directly or through others (a cycle a layers contract does not see: siblings of
one layer, modules of one package). Before issue 46 there were 4 module cycles and 5 package cycles."""

from __future__ import annotations

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

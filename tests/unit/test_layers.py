"""The package's structure stays what the README says: layers that import only downwards,
pure rules free of Spark, Kafka, Delta and Airflow, and no import cycles anywhere (imports
inside functions included: they hide cycles, they do not remove them)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

from ipcount.rules.config import REPO_ROOT


def import_cycles(package: str) -> list[list[str]]:
    """Every group of modules of ``package`` that import each other in a circle (strongly
    connected components of the import graph, found with Tarjan's algorithm), each as
    ``importer:line -> imported`` lines."""
    graph = grimp.build_graph(package, cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            group.add(v)
            if len(group) > 1 or v in edges[v]:
                cycles.append([f"{a}:{d['line_number']} -> {b}" for a in sorted(group)
                               for b in sorted(edges[a] & group)
                               for d in graph.get_import_details(importer=a, imported=b)])

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_the_layers_and_the_pure_rules_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout


def test_no_module_imports_itself_through_others():
    assert import_cycles("ipcount") == [] and import_cycles("ipcount_lab") == []


def test_the_checks_see_every_module():
    """A subpackage without ``__init__.py`` is invisible to grimp, and a check of nothing passes."""
    for package in ("ipcount", "ipcount_lab"):
        on_disk = {".".join(p.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
                   for p in (REPO_ROOT / package).rglob("*.py")}
        assert on_disk == set(grimp.build_graph(package, cache_dir=None).modules)


def test_a_cycle_hidden_in_a_function_is_found(tmp_path, monkeypatch):
    pkg = tmp_path / "toy_cycle"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from toy_cycle.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from toy_cycle.sub import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("toy_cycle") == [["toy_cycle.sub.a:1 -> toy_cycle.sub.b",
                                           "toy_cycle.sub.b:2 -> toy_cycle.sub.a"]]


def test_openlineage_stays_optional():
    """The OpenLineage provider is optional (bin/setup --lineage): the product and the DAGs
    import it only inside the functions that run where it is installed, never when a module
    loads."""
    import ast

    loaded, lazy = [], []
    for path in sorted([*(REPO_ROOT / "ipcount").rglob("*.py"), *(REPO_ROOT / "dags").glob("*.py"),
                        *(REPO_ROOT / "plugins").glob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inside = {id(n) for f in functions for n in ast.walk(f)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any("openlineage" in name for name in names):
                (lazy if id(node) in inside else loaded).append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert not loaded, f"OpenLineage imported when a module loads: {loaded}"
    assert lazy and all(at.startswith("ipcount/orchestration/lineage.py:") for at in lazy), lazy


def test_no_product_function_is_longer_than_60_lines():
    """A function that long does several things; name each (the product only: the lab and
    the tests may script at length)."""
    import ast

    long = []
    for path in sorted((REPO_ROOT / "ipcount").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert long == []

"""The packages' layout (README "Layout"): imports run one way.

Read from the code's own import statements (every ``import`` / ``from ... import``, including those
inside functions and under ``TYPE_CHECKING``), never by importing anything:

- no circle of modules in ``graders`` or ``reference``, nor of their sub-packages;
- ``reference`` never imports ``graders``;
- in ``graders``: the checking machine imports neither a chapter nor a course job nor the learner
  API of ``graders/__init__.py`` (it finds a chapter by exercise id, graders.machine.registry); the
  chapters import the machine and ``reference`` only, and the course jobs never import a chapter;
- every sub-package is named in the README's layout tree.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("graders", "reference")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in (``graders.machine.core.Case`` ->
    ``graders.machine.core``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of graders / reference it imports."""
    known = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in known.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                names = [f"{source}.{a.name}" for a in node.names] + [source]
            for name in names:
                target = _resolve(name, known)
                if target and target != mod:
                    deps.add(target)
        # "from graders.machine import core": the package and the submodule both resolve; keep the
        # submodule only (the package's __init__ is imported by Python anyway, it is not an edge)
        graph[mod] = {d for d in deps if not any(o != d and o.startswith(d + ".") for o in deps)} or deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _collapse(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The graph of sub-packages: each module named by its first ``depth`` parts."""
    def key(m: str) -> str:
        return ".".join(m.split(".")[:depth])
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(key(m), set()).update(key(d) for d in deps if key(d) != key(m))
    return out


def _edges(graph, src_prefix: str, dst_prefixes: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if m == src_prefix or m.startswith(src_prefix + ".")
                  for d in deps if any(d == p or d.startswith(p + ".") for p in dst_prefixes))


GRAPH = import_graph()


def test_the_graph_is_read():
    # a few imports every layout has: if these are not seen, the reader is broken, not the code
    assert "graders.machine.exercise" in GRAPH["graders.chapters.ch01"]
    assert "reference.batch_info" in GRAPH["reference.chunked"]
    assert "reference.engine.model_runner" in GRAPH["reference.engine.cuda_graph_runner"]


def test_no_circle_of_modules():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_circle_of_subpackages(pkg):
    sub = {m: d for m, d in _collapse(GRAPH, 2).items() if m.startswith(pkg)}
    assert _cycles(sub) == []
    engine = {m: d for m, d in _collapse(GRAPH, 3).items() if m.startswith("reference.engine")}
    assert _cycles(engine) == []


def test_reference_never_imports_graders():
    assert _edges(GRAPH, "reference", ("graders",)) == []


def test_the_machine_knows_no_chapter_and_no_course_job():
    assert _edges(GRAPH, "graders.machine", ("graders.chapters", "graders.course")) == []
    # nor the learner API above it (graders/__init__.py)
    assert [f"{m} -> graders" for m, deps in GRAPH.items() if m.startswith("graders.machine") and "graders" in deps] == []


def test_chapters_import_only_the_machine_and_reference():
    assert _edges(GRAPH, "graders.chapters", ("graders.course",)) == []
    assert [m for m, deps in GRAPH.items() if m.startswith("graders.chapters") and "graders" in deps] == []


def test_course_jobs_never_import_a_chapter():
    assert _edges(GRAPH, "graders.course", ("graders.chapters",)) == []


def test_the_ops_know_no_chapter_above_them():
    assert _edges(GRAPH, "reference.ops", ("reference.moe", "reference.tp", "reference.engine", "reference.layers",
                                            "reference.mem_pool", "reference.cuda_graph")) == []


def test_readme_layout_names_every_subpackage():
    text = (ROOT / "README.md").read_text()
    tree = re.search(r"## Layout\n.*?```\n(.*?)```", text, re.S)
    assert tree, "README has no layout tree"
    tree = tree.group(1)
    folders = sorted({p.parent.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")})
    for folder in folders:
        assert f"{folder.rsplit('/', 1)[-1]}/" in tree, f"{folder}/ is not in README's layout tree"

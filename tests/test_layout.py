"""The package stays one a reader holds (docs/design/index.md, "The map"): no module past 700 lines (the Lightning
seam's past 460), no folder past 15 modules (``__init__.py`` counted), no import cycle between its modules (an
import inside a function counts: it is a cycle all the same), and the engine and everything beneath it free of
Lightning."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_async_pp"
MAX_LINES, MAX_MODULES = 700, 15
# The seam stays thin: its largest file (docs/design/lightning.md, "The Lightning seam").
MAX_SEAM_LINES = 460
# Beneath the Lightning seam: the engine, the parallel dimensions, checkpoints, the planner and the trace writer.
NO_LIGHTNING = ["pipeline", "parallel", "checkpoint", "plan", "trace.py"]


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` (module ``name``) imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` folders up
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` imports the submodule `pkg.sub` where there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_of_the_package_is_longer_than_700_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules past {MAX_LINES} lines (split them by concern): {long}"


def test_the_seams_largest_file_stays_within_its_bound():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "strategy").glob("*.py")}
    assert max(sizes.values()) <= MAX_SEAM_LINES, sizes


def test_no_folder_of_the_package_holds_more_than_15_modules():
    crowded = {str(d.relative_to(ROOT)): n for d in [PACKAGE, *PACKAGE.rglob("*")] if d.is_dir()
               and (n := len(list(d.glob("*.py")))) > MAX_MODULES}
    assert not crowded, f"folders past {MAX_MODULES} modules (__init__.py counted): {crowded}"


def test_the_package_has_no_import_cycle():
    known = modules()
    graph = {name: imports(path, name, known) for name, path in known.items()}
    assert sum(len(v) for v in graph.values()) > 100, "the import graph came out nearly empty"
    found = cycles(graph)
    assert not found, f"modules that import each other, directly or around a loop: {found}"


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from pkg.b import f\n")
    b.write_text("def f():\n    from pkg import a\n")
    known = {"pkg.a": a, "pkg.b": b, "pkg": tmp_path / "__init__.py"}
    graph = {"pkg.a": imports(a, "pkg.a", known), "pkg.b": imports(b, "pkg.b", known), "pkg": set()}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


@pytest.mark.parametrize("where", NO_LIGHTNING)
def test_the_engine_and_what_it_stands_on_import_no_lightning(where):
    paths = [PACKAGE / where] if where.endswith(".py") else sorted((PACKAGE / where).rglob("*.py"))
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names), (path, names)
            assert not any(n.startswith(("lightning_async_pp.strategy", "lightning_async_pp.callbacks",
                                         "lightning_async_pp.module")) for n in names), (path, names)

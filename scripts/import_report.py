"""The import graph of dflash and tracing: circles, and imports made inside functions.

    python scripts/import_report.py        # counts, then each function-level import

An import circle is a strongly connected set of two or more modules in the graph that
grimp (import-linter's graph) builds, type-checking imports included. A function-level
project import is an `import` of a dflash or tracing module inside a function or class
body; each must carry a `# deferred: <why>` comment on its line (a heavy or optional
dependency that the caller should not pay for), or it is reported as unjustified.
Exit status 1 when there is a circle or an unjustified function-level import.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash", "tracing")
JUSTIFICATION = "# deferred:"


@dataclass(frozen=True)
class LateImport:
    """An import of a project module inside a function or class body."""

    path: str
    line: int
    module: str
    reason: str | None  # the text after `# deferred:`, None when there is none


def import_circles() -> list[list[str]]:
    """Each set of modules that import each other, directly or through others."""
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    return _strongly_connected(edges)


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of two or more modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _project_module(node: ast.AST) -> str | None:
    names = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    elif isinstance(node, ast.ImportFrom) and node.level > 0:
        return f"(relative) {node.module or ''}"
    return next((n for n in names if n.partition(".")[0] in PACKAGES), None)


def late_imports() -> list[LateImport]:
    """Every project import made inside a function or class body."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text().splitlines()
            tree = ast.parse("\n".join(lines))
            for scope in ast.walk(tree):
                if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                for node in ast.walk(scope):
                    module = _project_module(node)
                    if module is None:
                        continue
                    text = lines[node.lineno - 1]
                    reason = text.partition(JUSTIFICATION)[2].strip() or None
                    rel = path.relative_to(ROOT).as_posix()
                    found.append(LateImport(rel, node.lineno, module, reason))
    return sorted(set(found), key=lambda i: (i.path, i.line))


def main() -> int:
    circles, late = import_circles(), late_imports()
    unjustified = [i for i in late if i.reason is None]
    print(f"import circles: {len(circles)}")
    for circle in circles:
        print("  " + " -> ".join(circle))
    print(f"function-level project imports: {len(late)} ({len(unjustified)} unjustified)")
    for item in late:
        print(f"  {item.path}:{item.line}  {item.module}  -- {item.reason or 'NO REASON GIVEN'}")
    return 1 if circles or unjustified else 0


if __name__ == "__main__":
    sys.exit(main())

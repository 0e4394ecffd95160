"""Package-boundary counts of a checkout: private cross-package imports (``shardopt.X._*`` used
outside X), the names in shardopt.core's ``__all__``, and import cycles among core's modules
(every import counted, TYPE_CHECKING and function-level ones included).

    python scripts/count_boundaries.py [ROOT]
"""

from __future__ import annotations

import ast
import os
import re
import sys


def parsed(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read())


def source_files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(os.path.join(root, "packages")):
        if "/src/" in d:
            out += [os.path.join(d, n) for n in names if n.endswith(".py")]
    return out


def private_cross_imports(root: str) -> list[str]:
    out = []
    for path in source_files(root):
        mine = re.search(r"/src/shardopt/([^/.]+)", path)
        for node in ast.walk(parsed(path)):
            module = getattr(node, "module", None) or ""
            if not (isinstance(node, ast.ImportFrom) and module.startswith("shardopt.")):
                continue
            parts = module.split(".")
            private = any(p.startswith("_") for p in parts[2:]) or any(
                a.name.startswith("_") for a in node.names
            )
            if mine and parts[1] != mine.group(1) and private:
                out.append(f"{os.path.relpath(path, root)}: {module}")
    return out


def core_cycles(root: str) -> set[tuple[str, ...]]:
    core = os.path.join(root, "packages/core/src/shardopt/core")
    graph: dict[str, set[str]] = {}
    for name in os.listdir(core):
        if name.endswith(".py"):
            for node in ast.walk(parsed(os.path.join(core, name))):
                module = getattr(node, "module", None) or ""
                if isinstance(node, ast.ImportFrom) and module.startswith("shardopt.core."):
                    graph.setdefault(name[:-3], set()).add(module.split(".")[2])
    cycles: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in graph.get(node, ()):
            if nxt == start:
                cycles.add(tuple(sorted(set(path))))
            elif nxt not in path and len(path) < 8:
                walk(start, nxt, [*path, nxt])

    for node in list(graph):
        walk(node, node, [node])
    return cycles


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    cross = private_cross_imports(root)
    with open(os.path.join(root, "packages/core/src/shardopt/core/__init__.py")) as f:
        init = f.read()
    exported = re.findall(r'"[^"]+"', init[init.index("__all__") :])
    cycles = core_cycles(root)
    print(f"private cross-package imports: {len(cross)}")
    for line in cross:
        print(f"  {line}")
    print(f"shardopt.core __all__: {len(exported)} names")
    print(f"import cycles in core: {len(cycles)} {sorted(cycles)}")


if __name__ == "__main__":
    main()

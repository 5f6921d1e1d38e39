"""The layers of the design, checked on the source: ipc/ imports nothing else of kvrt;
runtime/ and workers/ never import each other (they meet only through ipc/'s messages); none of
them imports the benchmarks, the tests or the launcher; and runtime/ has no import circle (a
package counts as importing its __init__)."""
from __future__ import annotations

import ast
import os
import pathlib
import re

from tests.conftest import REPO

ROOT = pathlib.Path(REPO)
NEVER = {"ipc": ("kvrt.runtime", "kvrt.workers", "kvrt.bench", "kvrt.launcher", "tests"),
         "runtime": ("kvrt.workers", "kvrt.bench", "tests"),
         "workers": ("kvrt.runtime", "kvrt.bench", "kvrt.launcher", "tests")}
# starting a node from Python reuses the launcher's flag parser (imported when called)
ALLOWED = {("kvrt.runtime.client.launch", "kvrt.launcher")}


def module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("kvrt",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def imports(path: pathlib.Path) -> set[str]:
    """Every module `path` names in an import, at any depth (TYPE_CHECKING ones too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import (kvrt imports itself absolutely)"
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_each_layer_imports_only_what_it_may():
    for layer, never in NEVER.items():
        for path in (ROOT / layer).rglob("*.py"):
            name = module(path)
            for imported in imports(path):
                if (name, imported) not in ALLOWED:
                    assert not imported.startswith(never), f"{name} imports {imported}"
                top = imported.split(".")[0]
                assert top not in ("runtime", "workers", "ipc", "router", "bench", "launcher"), \
                    f"{name} imports {imported}: kvrt imports itself as kvrt.*"


OLD_IMPORT = re.compile(r"(?:^|[;\"']|\\n)\s*(?:from (?:runtime|ipc|workers|router|bench|launcher)(?:\.\w+)* import "
                        r"|import (?:runtime|ipc|workers|router|bench|launcher)(?:\.\w+)*(?: as |\s*[;,]|\s*$|\\n))", re.M)


def _own_sources() -> list[pathlib.Path]:
    """The repository's Python files; virtual environments (`.venv`, `.venv-kernels`, any
    hidden folder) and build folders are not walked into, only past: a torch install holds
    thousands of files."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "build"]
        found += [pathlib.Path(folder, f) for f in files if f.endswith(".py")]
    return found


def test_nothing_imports_the_old_top_level_names():
    """From the repository's root a snippet's `import runtime...` would still find the folder and
    load a second copy of kvrt beside the package: every import, in strings too, names kvrt.*."""
    for path in _own_sources():
        found = OLD_IMPORT.findall(path.read_text())
        assert not found, f"{path.relative_to(ROOT)}: {found}"


def _runtime_modules() -> dict[str, pathlib.Path]:
    return {module(p): p for p in (ROOT / "runtime").rglob("*.py")}


def test_runtime_has_no_import_circle():
    mods = _runtime_modules()

    def resolved(name: str) -> set[str]:
        """The runtime modules that importing `name` runs: it, if it is one, and its packages."""
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(3, len(parts) + 1) if ".".join(parts[:i]) in mods}

    graph = {}
    for name, path in mods.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {m for imp in imports(path) for m in resolved(imp)} - own - {name}
    done, stack = set(), []

    def visit(n):
        if n in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
        if n in done:
            return
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            visit(m)
        stack.pop()
        done.add(n)

    for n in sorted(graph):
        visit(n)

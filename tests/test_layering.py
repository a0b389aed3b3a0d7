"""The package layering: no import cycle between packages, and the kernel packages never import hybrid.

Every import statement counts, also those inside functions (a lazy import is still a dependency); imports that
only type checkers run (`if TYPE_CHECKING:`) count too, as dependencies of the design if not of the runtime.
A package is hybrid's subpackage or top-level module (hybrid.engine, hybrid.layers.forward_batch, ...), or one of the
top-level packages gpu, cpu_kernels and server. hybrid/__init__.py is the lazy public facade and not a node.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("hybrid", "gpu", "cpu_kernels", "server")


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in TOP:
        return None
    if parts[0] == "hybrid":
        return ".".join(parts[:2]) if len(parts) > 1 else None
    return parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute module names imported anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for top in TOP:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "hybrid" / "__init__.py":
                continue
            src = package_of(module_name(path))
            if src is None:
                continue
            deps = {package_of(m) for m in imported_modules(path)} - {None, src}
            graph.setdefault(src, set()).update(d for d in deps if (ROOT / Path(*d.split("."))).exists()
                                                or (ROOT / Path(*d.split("."))).with_suffix(".py").exists())
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_packages_import_each_other_without_cycles():
    graph = package_graph()
    assert {"hybrid.engine", "hybrid.layers", "hybrid.models", "hybrid.experts", "hybrid.mem_cache",
            "hybrid.graphs", "hybrid.managers", "hybrid.cli", "gpu", "server"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_kernel_packages_never_import_hybrid():
    graph = package_graph()
    for kernels in ("gpu", "cpu_kernels"):
        assert not {d for d in graph.get(kernels, ()) if d.startswith("hybrid") or d == "server"}, kernels


def test_the_engine_side_never_imports_the_api_process():
    graph = package_graph()
    assert not [src for src, deps in graph.items() if src.startswith("hybrid") and "server" in deps]


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_cpu_engine_runs_without_triton():
    """triton is an optional extra (gpu, test): a CPU-only install must load and run an engine without it."""
    code = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed here")
sys.meta_path.insert(0, NoTriton())
import hybrid.managers.engine_server
from hybrid import LLM, SamplingParams
out = LLM().generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
assert len(out.token_ids) == 3 and "triton" not in sys.modules
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]

"""Every @triton.jit function in gpu/ reads module globals only where compiled Triton allows it: names bound to
tl.constexpr(...). Triton's interpreter, which runs the kernels in the CPU tests, does not check this, so a kernel
reading a plain int global passed every test here and failed to compile on the first GPU."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"


def is_constexpr(value: ast.expr) -> bool:
    if isinstance(value, ast.Tuple):
        return all(is_constexpr(v) for v in value.elts)
    return isinstance(value, ast.Call) and ast.unparse(value.func) in ("tl.constexpr", "triton.language.constexpr")


def plain_globals(tree: ast.Module) -> set[str]:
    """Module-level names assigned a value that is not a tl.constexpr."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and not is_constexpr(node.value):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def jit_reads(tree: ast.Module, plain: set[str]) -> list[str]:
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            local = {a.arg for a in node.args.args + node.args.kwonlyargs}
            local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            found += [f"{node.name} reads {n.id}" for n in ast.walk(node)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in plain - local]
    return found


@pytest.mark.parametrize("path", sorted(GPU.glob("*.py")), ids=lambda p: p.name)
def test_kernels_read_only_constexpr_globals(path):
    tree = ast.parse(path.read_text())
    assert jit_reads(tree, plain_globals(tree)) == []


def test_the_check_sees_a_plain_global():
    tree = ast.parse("import triton\nimport triton.language as tl\nROWS = 16\nC = tl.constexpr(4)\n"
                     "@triton.jit\ndef k(x):\n    y = x * C\n    return y // ROWS\n")
    assert jit_reads(tree, plain_globals(tree)) == ["k reads ROWS"]

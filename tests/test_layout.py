"""The code's shape: modules under 400 lines, functions under about 60 unless they say why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def test_no_module_above_400_lines():
    long = {str(p.relative_to(ROOT)): n for pkg in ("verispec", "benchmarks") for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_a_function_above_60_lines_says_why():
    """A `# long: <why>` comment in the three lines above it (decorators included)."""
    unexplained = []
    for path in (ROOT / "verispec").rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                above = lines[max(0, first - 4): first - 1]
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and not any("# long:" in a for a in above):
                    unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert unexplained == []

"""The code's shape: modules under 400 lines, functions under about 60 unless they say why, and every
module with logic beside its own test file."""

from __future__ import annotations

import ast
import re
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


# Modules with no logic of their own to test (constants only).
NO_LOGIC = {
    "models/default.py",  # the bundled model's file name and path: a constant table
    "__main__.py",  # `python -m verispec`: calls the CLI's main (tests/test_cli.py runs it)
}
# Where two modules share a basename, the test file carries a qualifier.
QUALIFIED_TEST_FILES = {
    "spec_decode/metadata.py": "test_spec_metadata.py",
    "spec_decode/metrics.py": "test_spec_metrics.py",
    "sample/metadata.py": "test_sampling_metadata.py",
    "models/config.py": "test_model_config.py",
}
# Test files that reach their module through verispec's public names (`from verispec import LLM`)
# rather than by importing it: the engine end to end is how these modules are specified.
TESTED_THROUGH_PUBLIC_API = {
    "engine/llm_engine.py",
    "worker/runner.py",
    "sample/logprobs.py",
}


def imports_module(text: str, dotted: str) -> bool:
    """`verispec.a.b` named in the text, or `from verispec.a import b`."""
    parent, _, name = dotted.rpartition(".")
    return dotted in text or re.search(rf"from {re.escape(parent)} import \(?[^)]*\b{name}\b", text) is not None


def test_every_module_with_logic_has_its_test_file():
    """verispec/<path>/<name>.py is tested in tests/test_<name>.py (or its qualified name), which
    imports it."""
    missing = []
    for path in sorted((ROOT / "verispec").rglob("*.py")):
        rel = path.relative_to(ROOT / "verispec").as_posix()
        if path.name == "__init__.py" or rel in NO_LOGIC:
            continue
        test_file = ROOT / "tests" / QUALIFIED_TEST_FILES.get(rel, f"test_{path.stem}.py")
        dotted = "verispec." + rel.removesuffix(".py").replace("/", ".")
        if not test_file.exists():
            missing.append(f"{rel}: no {test_file.name}")
        elif rel not in TESTED_THROUGH_PUBLIC_API and not imports_module(test_file.read_text(), dotted):
            missing.append(f"{rel}: {test_file.name} does not import {dotted}")
    assert missing == []

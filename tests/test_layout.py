"""The layout rules of DESIGN.md that a test can hold."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_parallel_and_program_import_neither_simpy_nor_torch():
    for folder in ("parallel", "program", "numerics"):
        for f in (ROOT / "simcluster" / folder).glob("*.py"):
            assert not _imports(f) & {"simpy", "torch"}, f


def test_parallel_programs_load_without_simpy_or_torch_in_the_process():
    code = ("import sys; import simcluster.parallel.tp_dp_mlp, simcluster.parallel.collectives_demo; "
            "print(sorted(m for m in ('simpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_emulator_never_imports_torch():
    for f in (ROOT / "simcluster").rglob("*.py"):
        assert "torch" not in _imports(f), f

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


def _modules() -> dict[str, Path]:
    """Every module of the emulator and of the torch backend, by dotted name (a package by its own)."""
    out = {}
    for package in ("simcluster", "gpu_backend"):
        for f in (ROOT / package).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, anywhere in it (an import inside a function too: a cycle
    postponed to run time is still a cycle). `from package import name` is an edge to the submodule
    `name` where there is one, else to the package."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_imports_flow_one_way():
    """Issue 37: no two modules import each other, however indirectly, not even inside a function."""
    edges = import_graph()
    assert edges["simcluster.run.runner"] >= {"simcluster.run.job", "simcluster.run.budget"}  # (the walk sees imports)
    assert "gpu_backend.calibrate" in edges["simcluster.cli.calibrate"]  # (a command's lazy import counts)
    assert cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# The layers, lowest first: a module imports only from its own layer and those below it. Each entry names
# packages (simcluster's sub-packages and the torch backend) and top-level modules.
LAYERS = [
    ("numerics",),  # the kernel set in its three modes; the divisors an error lists
    ("model",),  # the single-device model: its blocks, AdamW, FLOPs and memory
    ("program",),  # what a per-rank program is given: mesh, groups, communication, context
    ("topology",),  # presets, the cluster's links, each collective's phases, measured profiles
    ("engine",),  # interpretation and timing of the programs, folding, the trace
    ("config",),  # the input: a scenario's keys, values and checks; the command line's options
    ("checkpoint",),  # the checkpoint's format (its __init__) and folder
    ("parallel",),  # the per-rank programs, and the single-device reference they are checked against
    ("report",),  # a run's report, and the sections it adds (critical batch, goodput)
    ("run",),  # the job a scenario runs, its budget, the runner, simulating less
    ("analysis", "testing"),  # analyses over many runs (plan, sweep); the public testing API
    ("viz",),  # renderers and exports
    ("gpu_backend",),  # the same programs on torch.distributed (its commands: `run --backend torch`, calibrate)
    ("cli", "__init__"),  # the command line: a module a command (simcluster/cli/)
]


def _layer(module: str) -> int:
    parts = module.split(".")
    name = parts[0] if parts[0] == "gpu_backend" else parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, names in enumerate(LAYERS) if name in names)


def test_no_module_imports_from_a_layer_above_its_own():
    """Issue 37: imports flow one way between the layers above (a new module must be placed in one)."""
    edges = import_graph()
    assert sum(_layer(t) < _layer(m) for m, targets in edges.items() for t in targets) > 100  # (it sees imports)
    assert sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets if _layer(t) > _layer(m)) == []


def test_the_package_offers_a_notebook_its_names_without_importing_them_up_front():
    """`import simcluster` loads none of its modules; `simcluster.load` and `simcluster.run_scenario`
    run the default scenario as the command line does."""
    code = ("import sys, simcluster; print(sorted(m for m in sys.modules if m.startswith('simcluster.'))); "
            "out = simcluster.run_scenario(simcluster.load(None, ['run.steps=1'])); "
            "print(out.report['verification']['bit_exact'], simcluster.testing.assert_bit_exact.__name__, "
            "isinstance(out, simcluster.Outcome), sorted(simcluster.__all__) == simcluster.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True assert_bit_exact True True"]
    try:
        import simcluster
        simcluster.no_such_name
    except AttributeError as exc:
        assert "no attribute 'no_such_name'" in str(exc)
    else:
        raise AssertionError("an unknown name must be an AttributeError")

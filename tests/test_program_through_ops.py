"""Programs touch data only through `ctx.ops` (the kernel set), so that the same program runs with numpy on
the host and with torch on a device: no numpy call in simcluster/parallel/ or simcluster/model/ outside
the functions below, each of which works on the host by design (what it makes is moved to the data's
device once, through `ops.from_host` or `ops.constant`, or it reads a finished run's results). A whole
step on torch's meta device (tests/test_torch_kernels.py) shows the same at run time."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "simcluster"
PROGRAMS = ("parallel", "model")

HOST_SIDE = {  # (module, function): why it may call numpy
    "parallel/positions.py:Positions.__array__": "positions a cp rank holds, as the host's index array",
    "parallel/llama_shard.py:rope_table": "the rotary table, once in float64, moved by ops.constant",
    "parallel/dp_wrap.py:DPWrap._owned": "which flat elements a rank owns, from shapes; moved by ops.from_host",
    "parallel/collectives_demo.py:collectives_demo": "integer test data made on the host, moved by ops.from_host",
    "model/config.py:batch": "the data loader: token ids made on the host, moved by ops.from_host",
    "model/moe.py:top_k": "the experts a token chooses, from its scores read back (as Megatron-Core reads its counts)",
    "model/flash.py:causal_share_at": "the share of a causal kernel's tiles it runs, from positions' runs",
    "model/moe.py:choose": "the node-limited choice among the same scores read back, host indices",
    "parallel/moe_shard.py:Experts.whole_sequences": "a count's shape, and the summed counts read back as host integers",
    "model/moe.py:route": "the dispatch's integer indices, from those choices; the kernel set moves them",
    "model/moe.py:capacity_keep": "which host choices an expert's capacity keeps, host booleans",
    "parallel/moe_shard.py:Experts.capacity_kept": "the sequence's choices gathered, read back as host integers",
    "model/moe.py:stated": "meta mode's stated token counts, from shapes",
    "parallel/expert_parallel.py:read_counts": "the all-gathered counts read back (the receivers' sizes)",
    "parallel/expert_parallel.py:AllGather._routes": "every ep rank's choices gathered, read back as host integers",
    "parallel/expert_parallel.py:AllGather._rows": "an expert's rows among the group's tokens, host indices",
    "parallel/expert_parallel.py:AllGather._join": "host index arrays joined; the kernel set moves them",
    "model/moe.py:host_float32": "host integers as an fp32 array; moved by ops.from_host",
    "parallel/moe_shard.py:bias_step": "the bias's change from the step's loads, read back; moved by ops.constant",
    "model/moe.py:Routing.tally": "the router's statistics, host integers counted from the dispatch",
    "model/moe.py:balance_gradient": "the balance loss's coefficients from the choice counts; moved by ops.constant",
    "parallel/composed.py:assemble": "a finished run's results, on the host, as one device's tensors",
    "parallel/composed.py:_agree": "the same, for replicas",
    "parallel/tp_dp_mlp.py:assemble": "the same, for the MLP program",
    "parallel/tensor_parallel.py:unshard": "the same, tensor-parallel pieces joined",
}
NUMPY_ONLY_METHODS = ("astype", "tobytes", "tolist", "item")


def offences(source: str, module: str) -> dict[str, list[str]]:
    """{'module:function': ['np.where at line 12', ...]} for every numpy call and numpy-only method."""
    found: dict[str, list[str]] = {}
    scope: list[str] = []

    class Walk(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            scope.append(node.name)
            self.generic_visit(node)
            scope.pop()

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

        def visit_Call(self, node):
            f = node.func
            what = None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("np", "numpy"):
                what = f"np.{f.attr}"
            elif isinstance(f, ast.Attribute) and f.attr in NUMPY_ONLY_METHODS:
                what = f".{f.attr}()"
            if what:
                found.setdefault(f"{module}:{'.'.join(scope)}", []).append(f"{what} at line {node.lineno}")
            self.generic_visit(node)

    Walk().visit(ast.parse(source))
    return found


def every_offence() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for package in PROGRAMS:
        for path in sorted((ROOT / package).glob("*.py")):
            out |= offences(path.read_text(), f"{package}/{path.name}")
    return out


def test_programs_call_no_numpy_on_data():
    found = every_offence()
    outside = {where: calls for where, calls in found.items() if where not in HOST_SIDE}
    assert not outside, "numpy on data in program code (go through ctx.ops):\n" + "\n".join(
        f"  {where}: {', '.join(calls)}" for where, calls in sorted(outside.items()))


def test_every_exemption_is_still_needed():
    stale = set(HOST_SIDE) - set(every_offence())
    assert not stale, f"exempted functions that no longer call numpy (remove them): {sorted(stale)}"


def test_the_walk_finds_a_numpy_call_on_data():
    """The walk can fail: the head split as it was written before the kernel set had it."""
    source = ("class GPT:\n    def split_heads(self, x):\n"
              "        return np.ascontiguousarray(x.reshape(2, 3, 4, 5).transpose(0, 2, 1, 3))\n"
              "    def cast(self, x):\n        return x.astype(np.float32)\n")
    assert offences(source, "model/gpt.py") == {
        "model/gpt.py:GPT.split_heads": ["np.ascontiguousarray at line 3"],
        "model/gpt.py:GPT.cast": [".astype() at line 5"]}


DATA_MOVERS = {"split", "concat", "reduce", "copy", "zeros_of"}  # tensor.py's numpy helpers (the emulator's)


def test_programs_take_no_numpy_helper_of_the_emulator():
    """tensor.py's split/concat/reduce are the emulator's collectives' numpy code: a program that takes
    them moves its data through numpy (as Megatron's scatter of pipeline messages once did)."""
    taken = []
    for package in PROGRAMS:
        for path in sorted((ROOT / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "simcluster.numerics.tensor":
                    taken += [f"{package}/{path.name}: {a.name}" for a in node.names if a.name in DATA_MOVERS]
    assert not taken, f"use ctx.ops (split) instead: {taken}"

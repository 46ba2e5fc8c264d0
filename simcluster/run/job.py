"""What a scenario runs, whichever backend runs it (the emulator, runner.py; torch.distributed,
gpu_backend/): the program, its arguments and mesh, its size and FLOPs, how to read and check its
results, and its injected faults. Apart from running it, so that what estimates a run before it starts
(budget.py, planner.py) reads the job without importing the runner."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterator

from simcluster import checkpoint
from simcluster import report as _report
from simcluster.config.scenario import Scenario, ScenarioError
from simcluster.config.schema import Section
from simcluster.engine import simulate
from simcluster.engine.faults import Faults
from simcluster.model.flops import step_flops
from simcluster.model.gpt import ModelConfig
from simcluster.model.optimizer import WEIGHT_DECAY
from simcluster.numerics.tolerance import training_bounds
from simcluster.parallel.allreduce_decomposed import allreduce_decomposed
from simcluster.parallel.collectives_demo import collectives_demo
from simcluster.parallel.composed import assemble as assemble_composed
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.parallel.reference import reference
from simcluster.parallel.tp_dp_mlp import MLPConfig, assemble, train_mlp
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import preset

COUNTABLE = 2**62  # what the emulator's int64 counters hold, with room to add (nanoseconds, bytes; budget.py too)
MAX_SLOWDOWN = 1e6  # a straggler's factor at most: kernel times stay far inside the int64 clock


def _mlp(sc: Scenario, mesh: DeviceMesh) -> tuple[MLPConfig, int, float]:
    for axis in ("pp", "cp"):
        if sc.parallel.degrees[axis] != 1:
            raise ScenarioError(f"run.program = 'mlp' uses dp and tp only; parallel.{axis}={sc.parallel.degrees[axis]} "
                                f"needs a program that has that axis")
    m, r = sc.model, sc.run
    with _as_scenario_error():
        cfg = MLPConfig(hidden=m.hidden, ffn_hidden=m.ffn_hidden, tokens=m.global_batch * m.seq,
                        steps=r.steps, lr=r.lr, seed=r.seed)
        cfg.check_mesh(mesh.sizes["dp"], mesh.sizes["tp"])
    return cfg, cfg.parameters, 6.0 * cfg.parameters * cfg.tokens * cfg.steps


@contextmanager
def _as_scenario_error() -> Iterator[None]:
    """A configuration the programs reject is the user's mistake: one line, no traceback."""
    try:
        yield
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None


RESOLVED = {"tied_head", "weight_decay", "clip_grad"}  # keys whose None in a scenario parallelism_of resolves


def alike(cls: type, *sections: Section) -> dict[str, Any]:
    """The values of `cls`'s fields that the sections hold under the same names (one name, one meaning:
    tests/test_config.py checks that each such field takes the key's values), less RESOLVED."""
    names = {f.name for f in fields(cls)} - RESOLVED
    return {f.name: getattr(s, f.name) for s in sections for f in fields(s) if f.name in names}


def parallelism_of(sc: Scenario, mesh: DeviceMesh) -> Parallelism:
    """The scenario's GPT/Llama layout on `mesh`, checked (a ScenarioError says what is impossible)."""
    m, p, r = sc.model, sc.parallel, sc.run
    dp = mesh.sizes["dp"]
    micro = m.micro_batch
    with _as_scenario_error():
        model = ModelConfig(**alike(ModelConfig, m), seed=r.seed, recompute=p.recompute,
                            tied_head=m.arch == "gpt" if m.tied_head is None else m.tied_head)
        per_rank, rest = divmod(m.global_batch, dp)
        if rest:
            raise ValueError(f"model.global_batch={m.global_batch} must be divisible by parallel.dp={dp}")
        if micro is not None and per_rank % micro:
            raise ValueError(f"model.micro_batch={micro} must divide each rank's {per_rank} sequences "
                             f"(global_batch {m.global_batch} / dp {dp})")
        cfg = TrainingConfig(**alike(TrainingConfig, m, p, r), model=model,
                             micro_batches=per_rank // (micro or per_rank), precision=m.dtype,
                             weight_decay=WEIGHT_DECAY[m.arch] if r.weight_decay is None else r.weight_decay,
                             clip_grad=r.clip_grad or None)
        if p.delayed_update and (r.save_checkpoint or r.resume):
            raise ValueError("a checkpoint with the delayed parameter update is not modelled: the weights the "
                             "next step uses are not those the checkpoint holds; set parallel.delayed_update = "
                             "false to save or resume")
        if p.schedule == "interleaved" and p.pp > 1 and not p.microbatch_group and cfg.micro_batches % p.pp:
            raise ValueError(f"the interleaved schedule needs each rank's micro-batch count ({cfg.micro_batches}) "
                             f"to be a multiple of pp={p.pp}: set model.micro_batch so that global_batch / dp / "
                             f"micro_batch is a multiple of {p.pp}, or parallel.microbatch_group (Megatron-LM's "
                             f"--microbatch-group-size-per-vp-stage) to one that m is a multiple of, or leaves at "
                             f"least {p.pp} after")
        parallelism = Parallelism(**alike(Parallelism, p), data=cfg, virtual=p.virtual_stages,
                                  dispatcher=p.moe_dispatcher, checkpoint=checkpoint.of(sc))
        parallelism.check(**mesh.sizes)
    return parallelism


@dataclass(frozen=True)
class Job:
    """What a scenario runs, whichever backend runs it: `program(ctx, *args)` on every rank of `mesh`,
    and how to read its results. `outputs(results)`: the named outputs of a run (results by rank) in
    the single-device view; `check(results)`: the verdict against one device (report.verification).
    `fold`: the sets of ranks that may stand for each other in meta mode (engine/fold.py)."""

    program: Any
    args: tuple[Any, ...]
    mesh: DeviceMesh
    mode: str
    parameters: int
    flops: tuple[float, float, float]  # model FLOPs (full square), hardware FLOPs, model FLOPs (causal)
    tokens: int
    outputs: Any
    check: Any
    fold: tuple = ()
    bounds: Any = None  # fast mode: name -> the relative error allowed (numerics/tolerance.py), or None
    steps: int | None = None  # the steps run, when not run.steps (resumed from a checkpoint)


def _verdict(sc: Scenario, check: Any) -> Any:
    mode = sc.run.numerics
    if not sc.run.verify:
        return lambda results: {"mode": mode, "status": "not requested (run.verify = false)"}
    if mode == "meta":
        return lambda results: {"mode": mode, "status": "not applicable: meta mode carries no numbers"}
    return check


def _limbs(x: Any) -> Any:
    return x.limbs if hasattr(x, "limbs") else x


def job_of(sc: Scenario, *, fold: bool = True) -> Job:
    """The scenario's program, arguments and checks (a ScenarioError says what is impossible)."""
    with _as_scenario_error():
        mesh = DeviceMesh(**sc.parallel.degrees, ep=sc.parallel.ep)
    mode, program = sc.run.numerics, sc.run.program
    coords = [mesh.coords(r) for r in range(mesh.world_size)]
    if program == "transformer":
        parallelism = parallelism_of(sc, mesh)
        cfg = parallelism.data
        tokens = cfg.global_batch * cfg.model.seq
        start = checkpoint.start_step(sc)
        outputs = lambda results: _from(start, assemble_composed(results, coords, parallelism))  # noqa: E731
        m = cfg.model
        bounds = training_bounds(cfg.precision, m.layers, max(m.hidden, m.ffn_hidden, m.seq, m.vocab, tokens))
        return Job(composed, (parallelism,), mesh, mode, cfg.model.parameters,
                   tuple(f * (cfg.steps - start) for f in step_flops(cfg.model, tokens)), tokens, outputs,
                   _verdict(sc, lambda results: _report.verification(mode, _from(start, reference(cfg, mode)),
                                                                     outputs(results), bounds)),
                   parallelism.alike(mesh.sizes["tp"], mesh.sizes["cp"]) if fold and mode == "meta" else (), bounds,
                   cfg.steps - start)
    if program == "mlp":
        cfg, parameters, model_flops = _mlp(sc, mesh)
        outputs = lambda results: assemble(results, coords)  # noqa: E731

        def check(results: list[Any]) -> dict[str, Any]:
            one = DeviceMesh()
            ref = simulate(train_mlp, cfg, mesh=one, cluster=preset(sc.cluster.preset, nodes=1, gpus_per_node=1),
                           mode=mode, cost_dtype=sc.model.dtype)
            return _report.verification(mode, assemble(ref.results, [one.coords(0)]), outputs(results))
        return Job(train_mlp, (cfg,), mesh, mode, parameters, (model_flops,) * 3, cfg.tokens, outputs,
                   _verdict(sc, check))
    if program == "allreduce":
        elements = sc.model.global_batch * sc.model.seq * sc.model.hidden

        def outputs(results: list[Any]) -> dict[str, Any]:
            return {f"rank{r}.{k}": _limbs(v) for r, res in enumerate(results) for k, v in res.items()}

        def check(results: list[Any]) -> dict[str, Any]:
            verdict = _report.verification(
                mode, {f"rank{r}": _limbs(res["all_reduce"]) for r, res in enumerate(results)},
                {f"rank{r}": _limbs(res["reduce_scatter+all_gather"]) for r, res in enumerate(results)})
            return verdict | {"reference": "the all-reduce's result"}
        return Job(allreduce_decomposed, (elements, sc.run.seed), mesh, mode, 0, (0.0,) * 3, 0, outputs,
                   check if mode != "meta" else _verdict(sc, check))

    def every_output(results: list[Any]) -> dict[str, Any]:
        return {f"rank{r}.{k}": _limbs(v) for r, res in enumerate(results) for k, v in res.items()}
    return Job(collectives_demo, (sc.run.seed,), mesh, mode, 0, (0.0,) * 3, 0, every_output,
               lambda results: {"mode": mode, "status": "not applicable: the collectives program has no "
                                "single-device form (its results are checked against their definitions by the "
                                "test suite)"})


def _from(start: int, outputs: dict[str, Any]) -> dict[str, Any]:
    """The outputs of a run resumed at step `start`: its losses, and the first step's gradients only
    when that step is the first of the training."""
    if not start:
        return outputs
    return {k: v for k, v in outputs.items() if not k.startswith("first_grads.")
            and not (k.startswith("loss[") and int(k[5:-1]) < start)
            and not (k.startswith("routing[") and int(k[8:k.index("]")]) < start)}


def faults_of(sc: Scenario) -> Faults | None:
    """The scenario's [faults], checked against its mesh (None: none)."""
    f, world = sc.faults, sc.world_size
    for key in ("straggler_rank", "degraded_rank", "failed_rank"):
        if getattr(f, key) is not None and getattr(f, key) >= world:
            raise ScenarioError(f"faults.{key} = {getattr(f, key)} is not a rank of this scenario: ranks are 0 to {world - 1}")
    if f.degraded_rank is not None and not 0 < f.degraded_factor <= 1:
        raise ScenarioError(f"faults.degraded_factor = {f.degraded_factor!r} must be above 0 and at most 1 (the "
                            f"fraction of its bandwidth the link keeps)")
    if f.degraded_rank is not None and sc.cluster_spec().torus:
        raise ScenarioError("faults.degraded_rank: a torus (cluster.torus) has no NIC or NVLink port to degrade; "
                            "a degraded link between chips is not modelled")
    if f.failed_rank is not None and f.watchdog_s <= 0:
        raise ScenarioError("faults.watchdog_s must be above 0")
    if f.straggler_rank is not None and f.straggler_factor > MAX_SLOWDOWN:
        raise ScenarioError(f"faults.straggler_factor = {f.straggler_factor!r}: at most {MAX_SLOWDOWN:.0e} (a "
                            f"millisecond's kernel would take {MAX_SLOWDOWN / 1e3 / 60:.0f} minutes)")
    for key, ns in (("straggler_from_us", 1e3), ("failed_at_us", 1e3), ("watchdog_s", 1e9)):
        if getattr(f, key) * ns > COUNTABLE:  # (the emulator's clock: int64 nanoseconds)
            raise ScenarioError(f"faults.{key} = {getattr(f, key)!r} is past the emulator's clock, which counts int64 "
                                f"nanoseconds: at most {COUNTABLE / ns:.3g} ({COUNTABLE / 1e9 / 86400 / 365:.0f} years)")
    faults = Faults(
        straggler=None if f.straggler_rank is None else (f.straggler_rank, f.straggler_factor,
                                                            round(f.straggler_from_us * 1e3)),
        degraded=None if f.degraded_rank is None else (f.degraded_rank, f.degraded_link, f.degraded_factor),
        failed=None if f.failed_rank is None else (f.failed_rank, round(f.failed_at_us * 1e3)),
        watchdog_ns=round(f.watchdog_s * 1e9))
    return faults or None

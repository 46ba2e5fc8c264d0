"""Any scenario on torch.distributed: a preflight on the emulator, the ranks on torch, and a report that
puts what was measured beside what the emulator predicted.

    prepare   the scenario's job (simcluster.run.job.job_of) for torch: numbers (exact or fast mode),
              one variant, as many processes as the mesh has ranks;
    preflight the job on the emulator in meta mode (shapes only, seconds; backend.preflight on the
              scenario's cluster): a mismatched collective or a deadlock is refused with the emulator's
              diagnosis before any process starts;
    emulate   the emulator's run: its prediction, and with run.verify its numbers, in the same mode (else
              meta mode, which predicts the same times at any size); `expected`: its outputs' digests,
              by rank, which each rank checks its own against (digests.py);
    launch    the ranks (backend.launch, or torchrun's processes calling backend.measured), which send back
              a digest for each output the emulator computed the same, the output only where it differs;
    finish    the report: the emulator's, with a `torch` section of measured figures and of how the real
              run's outputs compare with the emulator's and with one device's.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import numpy as np

from gpu_backend.backend import preflight
from gpu_backend.digests import digests, restore
from simcluster import checkpoint
from simcluster.config.scenario import Scenario, ScenarioError
from simcluster.report import relative_error
from simcluster.run.job import Job, faults_of, job_of
from simcluster.run.runner import Outcome, checkpoints, run_scenario


FLOAT_REDUCTION = 1e-5  # a float sum in another order: the collectives and mlp programs' (relative norm)


def prepare(sc: Scenario, nproc: int | None = None) -> Job:
    if sc.variants:
        labels = ", ".join(label for label, _ in sc.variants)
        raise ScenarioError(f"scenario {sc.name!r} compares {len(sc.variants)} variants ({labels}); the torch backend "
                            f"runs one scenario: use a copy without its [compare] table")
    if sc.run.numerics == "meta":
        raise ScenarioError("the torch backend computes numbers: set run.numerics to exact or fast (meta mode "
                            "carries shapes only)")
    if faults_of(sc) is not None:
        raise ScenarioError("[faults] are injected into the emulator's timed run; the torch backend runs real "
                            "processes and cannot fail them on cue: run it without --backend torch")
    checkpoint.check_scenario(sc)
    job = job_of(sc, fold=False)
    world = job.mesh.world_size
    if nproc is not None and nproc != world:
        sizes = " x ".join(f"{a}{n}" for a, n in job.mesh.sizes.items() if n > 1) or "one rank"
        raise ScenarioError(f"the scenario's mesh ({sizes}) has {world} ranks, one process each: --nproc {nproc} "
                            f"does not match (change parallel.dp/pp/cp/tp, or use --nproc {world})")
    return job


def check(sc: Scenario, job: Job) -> None:
    """The preflight: the job on the emulator in meta mode, on the scenario's cluster."""
    preflight(job.program, job.args, job.mesh, sc.cluster_spec(), sc.model.dtype)


def _same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def against(expected: dict[str, Any], got: dict[str, Any], bounds: Any = None) -> dict[str, Any]:
    """How the real run's outputs compare with the emulator's: byte-identical, within the bound `bounds`
    gives an output (relative norm error; None: not compared, as fast mode's weights after Adam), or
    different. Without `bounds`, bytes only."""
    identical, within, uncompared, differ = 0, 0, 0, []
    for name in expected:
        bound = None if bounds is None else bounds(name)
        if name in got and _same(got[name], expected[name]):
            identical += 1
        elif name in got and bounds is not None and bound is None:
            uncompared += 1
        elif name in got and bound is not None and relative_error(got[name], expected[name]) <= bound:
            within += 1
        else:
            differ.append(name)
    differ += [name for name in got if name not in expected]
    return {"compared": len(expected) - uncompared, "identical": identical, "within_tolerance": within,
            "not_compared": uncompared, "differ": differ[:10], "differing": len(differ), "passed": not differ}


def emulate(sc: Scenario, job: Job) -> Outcome:
    """The emulator's run of the scenario: the prediction, and with run.verify the numbers to compare."""
    # (the real ranks write the checkpoint: the emulator's run only reads one, and the manifest is theirs)
    verify = sc.run.verify
    return run_scenario(replace(sc, run=replace(sc.run, save_checkpoint=None, save_at_step=None,
                                             numerics=job.mode if verify else "meta")), fold=not verify)


def expected(sc: Scenario, emulated: Outcome) -> list[Any] | None:
    """The digests of the emulator's outputs, by rank (None without run.verify: nothing is compared)."""
    return [digests(r) for r in emulated.result.results] if sc.run.verify else None


def apart(sc: Scenario, section: dict[str, Any]) -> list[str]:
    """Why the measured step is more than 2x from the predicted one, as far as the tool knows it: the
    prediction's hardware is not the one that ran, or the ranks shared too few cores ([] within 2x)."""
    measured, predicted = max(section["step_time_s"].values()), section["predicted_step_time_s"]
    if not predicted or 0.5 <= measured / predicted <= 2:
        return []
    out = [f"measured {measured / predicted:.3g}x the prediction"]
    spec = sc.cluster_spec()
    if not sc.cluster.profile:
        out.append(f"the prediction is for the scenario's cluster ({spec.preset}: {spec.device}), not this "
                   f"{section['device']}: time it against this machine with `simcluster calibrate` and "
                   f"--set cluster.profile=FILE")
    cores = os.cpu_count() or 1
    if section["device"] == "cpu" and section["processes"] > cores:
        out.append(f"{section['processes']} ranks shared {cores} cores")
    return out


def finish(sc: Scenario, job: Job, runs: list[Any], backend: str, emulated: Outcome) -> Outcome:
    """The emulator's run of the scenario beside the real one (`runs`: backend.RankRun by rank, their
    results against `expected(sc, emulated)`)."""
    verify = sc.run.verify  # (without it the ranks sent no outputs back: nothing to restore)
    real = [restore(run.result, mine) for run, mine in zip(runs, emulated.result.results)] if verify \
        else [run.result for run in runs]
    steps = emulated.report["steps"]
    # Exact mode is byte-identical on any backend, except a plain float reduction (the collectives
    # program's), whose order is the backend's; fast mode leaves every sum's order to it, and is held
    # to the derived bound (numerics/tolerance.py) where the program has one.
    if job.mode == "exact":
        bounds = (lambda name: FLOAT_REDUCTION) if sc.run.program == "collectives" else None
    else:
        bounds = job.bounds or (lambda name: FLOAT_REDUCTION)
    section = {
        "backend": backend,
        "device": "cuda" if backend == "nccl" else "cpu",
        "processes": len(runs),
        "step_time_s": {str(r): run.seconds / steps for r, run in enumerate(runs)},
        # (as the step_time_s beside it is measured: the whole program, initialisation included, a step)
        "predicted_step_time_s": emulated.report["total_time_ns"] / steps / 1e9,
        "peak_memory_bytes": {str(r): run.peak_bytes for r, run in enumerate(runs)},
        "memory_measure": runs[0].memory_source,
        "outputs_sent": {"outputs": sum(run.outputs for run in runs), "sent_whole": sum(run.sent for run in runs),
                         "rest": "digests equal to the emulator's" if verify else "not sent back (not compared)"},
        "against_emulator": (against(job.outputs(emulated.result.results), job.outputs(real), bounds) if verify
                             else {"status": "not requested (run.verify = false): the prediction ran in meta mode",
                                   "passed": True}),
        "verification": job.check(real),
    }
    section["apart"] = apart(sc, section)
    section["passed"] = section["against_emulator"]["passed"] and section["verification"].get("passed", True)
    return Outcome(sc, emulated.result, dict(emulated.report, torch=section) | checkpoints(sc, job, real))

"""The composed GPT program on torch.distributed (gloo) gives the emulator's bytes in exact mode: each
family alone from the command line (`simcluster run --backend torch`), and a 4D layout on 8 processes,
compared here byte for byte."""

import contextlib
import io
import json

import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")

from byte_compare import assert_same_bytes  # noqa: E402
from gpu_backend.backend import spawn  # noqa: E402
from simcluster.cli import main  # noqa: E402
from simcluster.engine import simulate  # noqa: E402
from simcluster.model.gpt import ModelConfig  # noqa: E402
from simcluster.parallel.composed import assemble, composed  # noqa: E402
from simcluster.parallel.data_parallel import TrainingConfig  # noqa: E402
from simcluster.parallel.parallelism import Parallelism  # noqa: E402
from simcluster.parallel.reference import reference  # noqa: E402
from simcluster.program.mesh import DeviceMesh  # noqa: E402
from simcluster.topology.presets import preset  # noqa: E402

pytestmark = pytest.mark.torch


def same_on_gloo(data, mesh, **options):
    parallelism = Parallelism(data=data, **options)
    real = spawn(composed, parallelism, mesh=mesh, backend="gloo")
    emulated = simulate(composed, parallelism, mesh=mesh, cluster=preset("dgx-a100", gpus_per_node=mesh.world_size)).results
    coords = [mesh.coords(r) for r in range(mesh.world_size)]
    a, b = assemble(emulated, coords, parallelism), assemble(real, coords, parallelism)
    assert_same_bytes(b, a)  # torch.distributed gives the emulator's bytes
    assert_same_bytes(b, reference(data), only_wanted=True)  # and both equal one device


def on_torch(*sets):
    """`simcluster run --backend torch --json` with these --set overrides: the report. The command's main
    runs in this process, as `python -m simcluster.cli` would run it, so that the ranks' fork server (which
    imports torch, 2-3 s here) starts once a test worker, not once a test; tests/test_torch_launch.py runs
    the command as a process of its own."""
    args = ["run", "--backend", "torch", "--json", "--watchdog", "60", "--timeout", "300"]
    for s in sets:
        args += ["--set", s]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(args)
    assert status == 0, err.getvalue()[-2000:]
    return json.loads(out.getvalue())


def byte_identical_everywhere(report):
    torch_run = report["torch"]
    same = torch_run["against_emulator"]
    assert same["compared"] > 0 and same["identical"] == same["compared"] and not same["differ"], same
    assert torch_run["verification"]["bit_exact"], torch_run["verification"]["mismatches"]
    sent = torch_run["outputs_sent"]  # a digest for each output (all equal the emulator's), no output whole
    assert sent["outputs"] > 0 and sent["sent_whole"] == 0, sent
    assert sorted(torch_run["step_time_s"]) == sorted(report["memory_peak_bytes"])  # a measure for every rank
    assert all(t > 0 for t in torch_run["step_time_s"].values())


SMALL = ("run.steps=2", "model.dropout=0.1")


# one of each family in the default run; the rest with -m slow
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_data_parallel_from_the_command_line(stage):
    report = on_torch(*SMALL, f"parallel.zero={stage}", "parallel.dp=3", "cluster.gpus_per_node=3", "model.layers=1",
                      "model.hidden=8", "model.heads=2", "model.ffn_hidden=12", "model.seq=4", "model.vocab=10",
                      "model.global_batch=6", "model.micro_batch=1", f"model.dtype={'bf16' if stage % 2 else 'fp32'}")
    byte_identical_everywhere(report)


@pytest.mark.parametrize("stage,optimizer,params,delayed", [(3, "cpu", "nvme", "true"), (1, "cpu", "none", "false"),
                                                             pytest.param(2, "nvme", "none", "false", marks=pytest.mark.slow)])
def test_offload_from_the_command_line(stage, optimizer, params, delayed):
    """ZeRO-Offload/Infinity's copies are real copies between the device (or gloo's CPU tensors) and
    host memory on torch: the same bytes, the delayed update's own reference."""
    report = on_torch(*SMALL, f"parallel.zero={stage}", f'parallel.offload_optimizer="{optimizer}"',
                      f'parallel.offload_params="{params}"', f"parallel.delayed_update={delayed}", "parallel.dp=2",
                      "cluster.gpus_per_node=2", "model.layers=1", "model.hidden=8", "model.heads=2",
                      "model.ffn_hidden=12", "model.seq=4", "model.vocab=10", "model.global_batch=4",
                      "model.micro_batch=1", "model.dtype=bf16", "run.steps=3")
    byte_identical_everywhere(report)
    assert {r["group"] for r in report["communication"]} >= {"gpu->cpu", "cpu->gpu" if params == "none" else "nvme->gpu"}


@pytest.mark.parametrize("sp,overlap,backward", [pytest.param("false", "false", "false", marks=pytest.mark.slow),
                                                 pytest.param("true", "false", "false", marks=pytest.mark.slow),
                                                 pytest.param("true", "true", "false", marks=pytest.mark.slow),
                                                 ("true", "true", "true")])
def test_tensor_parallel_from_the_command_line(sp, overlap, backward):
    """(With the overlap, parallel.tp_comm_overlap: the ring exchange's sends and receives between tp peers on
    gloo, and with Megatron-LM's backward, parallel.tp_async_backward, the re-gather and the reduction under
    the weight gradients; torch's async TP, the overlap alone, runs the forward's pieces again in the backward;
    plain sequence parallelism runs in the 4D hybrids by default.)"""
    byte_identical_everywhere(on_torch(*SMALL, "parallel.dp=2", "parallel.tp=2", f"parallel.sp={sp}",
                                       f"parallel.tp_comm_overlap={overlap}", f"parallel.tp_async_backward={backward}",
                                       "parallel.zero=0", "cluster.gpus_per_node=4", "model.layers=2", "model.hidden=8",
                                       "model.heads=4", "model.ffn_hidden=8", "model.seq=4", "model.vocab=8",
                                       "model.tied_head=true", "model.global_batch=4", "model.micro_batch=1"))


@pytest.mark.parametrize("attention", ["ulysses", "ring", pytest.param("allgather", marks=pytest.mark.slow), "rsa"])
def test_context_parallel_from_the_command_line(attention):
    byte_identical_everywhere(on_torch(*SMALL, "parallel.dp=2", "parallel.cp=2", f"parallel.attention={attention}",
                                       "cluster.gpus_per_node=4", "model.layers=2", "model.hidden=8", "model.heads=4",
                                       "model.ffn_hidden=8", "model.seq=4", "model.vocab=9", "model.global_batch=2"))


def test_grouped_query_attention_taken_as_it_is_on_gloo():
    """model.gqa = "native" (the kv heads gathered as they are, their gradients summed over the query heads
    before they are rounded), on torch's exact kernels: the emulator's bytes."""
    byte_identical_everywhere(on_torch(*SMALL, "parallel.dp=1", "parallel.cp=2", "parallel.attention=allgather",
                                       "cluster.gpus_per_node=2", "model.arch=llama", "model.tied_head=false",
                                       "model.kv_heads=1", "model.gqa=native", "model.layers=2", "model.hidden=8",
                                       "model.heads=4", "model.ffn_hidden=8", "model.seq=4", "model.vocab=9",
                                       "model.global_batch=2"))


@pytest.mark.parametrize("schedule,p,v,dp", [pytest.param("gpipe", 2, 1, 2, marks=pytest.mark.slow),
                                             pytest.param("1f1b", 4, 1, 1, marks=pytest.mark.slow),
                                             ("interleaved", 2, 2, 1), ("zb-h1", 3, 1, 1), ("zb-v", 2, 1, 1),
                                             ("dualpipe", 2, 1, 2)])
def test_pipeline_from_the_command_line(schedule, p, v, dp):
    """DualPipe: half the micro-batches enter at each end, its copies' gradients summed over the pp-mirror
    group. ZB-H1 and DualPipe with a tied head: the last stage holds a copy of the embedding, the first
    and the last sum their gradients of it (Megatron-LM's embedding group)."""
    m = 2 * p
    tied = "true" if schedule in ("zb-h1", "dualpipe") else "false"
    byte_identical_everywhere(on_torch(
        *SMALL, f"parallel.dp={dp}", f"parallel.pp={p}", f"parallel.schedule={schedule}",
        f"parallel.virtual_stages={v}", "parallel.zero=0", f"cluster.gpus_per_node={dp * p}",
        f"model.layers={p * (2 if schedule == 'zb-v' else v) + 1}", "model.hidden=4", "model.heads=2", "model.ffn_hidden=6", "model.seq=3",
        "model.vocab=7", f"model.tied_head={tied}", f"model.global_batch={dp * m}", "model.micro_batch=1"))


@pytest.mark.parametrize("program", ["mlp", "allreduce", "collectives"])
def test_the_other_programs_from_the_command_line(program):
    report = on_torch(f"run.program={program}", "parallel.dp=2", "parallel.tp=2" if program == "mlp" else "parallel.tp=1",
                      f"cluster.gpus_per_node={4 if program == 'mlp' else 2}", "model.hidden=8", "model.ffn_hidden=16",
                      "model.seq=2", "model.global_batch=4", "parallel.zero=0", "run.steps=2")
    same = report["torch"]["against_emulator"]
    assert same["compared"] > 0 and same["passed"] and not same["differ"], same
    if program != "collectives":  # (no single-device form)
        assert report["torch"]["verification"]["passed"]
    if program == "mlp":  # exact mode, no float reduction of its own: every byte
        assert same["identical"] == same["compared"]


@pytest.mark.parametrize("zero,attention", [(3, "ring")])
def test_4d(zero, attention):
    """pp2 x cp2 x tp2 with SP, dropout and selective recomputation, ZeRO-3 over cp: 8 processes."""
    model = ModelConfig(layers=2, hidden=8, heads=4, ffn_hidden=8, seq=8, vocab=8, tied_head=False, dropout=0.1,
                      recompute="selective")
    data = TrainingConfig(model=model, global_batch=2, micro_batches=2, steps=2, precision="bf16", zero=zero)
    same_on_gloo(data, DeviceMesh(pp=2, cp=2, tp=2), sp=True, attention=attention, schedule="1f1b")


def within_the_fast_tolerance(report):
    torch_run = report["torch"]
    same = torch_run["against_emulator"]
    assert same["compared"] > 0 and same["passed"] and not same["differ"], same
    assert torch_run["verification"]["passed"], torch_run["verification"]
    assert torch_run["passed"]


FAMILIES = {  # one layout per family, and a 4D hybrid, each small
    "zero3": ("parallel.dp=2", "parallel.zero=3", "cluster.gpus_per_node=2"),
    "tp+sp": ("parallel.dp=1", "parallel.tp=2", "parallel.sp=true", "parallel.zero=0", "cluster.gpus_per_node=2"),
    "cp-ring": ("parallel.dp=1", "parallel.cp=2", "parallel.attention=ring", "cluster.gpus_per_node=2"),
    "pp-1f1b": ("parallel.dp=1", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.zero=0", "cluster.gpus_per_node=2"),
    "4d": ("parallel.dp=1", "parallel.pp=2", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=1",
           "parallel.attention=ulysses", "parallel.schedule=1f1b", "cluster.gpus_per_node=8"),
}


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.slow),
                                   pytest.param("fp32", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_mode_from_the_command_line(family, dtype):
    """Fast mode on torch.distributed agrees with the emulator's fast run, and with one device, within the
    derived tolerance (numerics/tolerance.py)."""
    within_the_fast_tolerance(on_torch(
        *SMALL, "run.numerics=fast", f"model.dtype={dtype}", *FAMILIES[family], "model.layers=2", "model.hidden=8",
        "model.heads=4", "model.ffn_hidden=8", "model.seq=4", "model.vocab=8", "model.tied_head=false",
        "model.global_batch=4", "model.micro_batch=1"))


def test_a_checkpoint_saved_on_gloo_resumes_on_the_emulator_and_back(tmp_path):
    """torch.distributed's ranks write the checkpoint (each its own file, rank 0's process the manifest);
    the emulator resumes it under another layout bit-exact, and a checkpoint the emulator saved resumes
    on gloo."""
    from simcluster.run.runner import run_scenario
    from simcluster.config.scenario import build

    model = ["model.layers=2", "model.hidden=8", "model.heads=2", "model.ffn_hidden=12", "model.seq=4",
             "model.vocab=10", "model.global_batch=4", "model.tied_head=false"]
    saved = tmp_path / "on_gloo"
    report = on_torch(*model, "run.steps=2", "parallel.dp=2", "parallel.zero=3", "cluster.gpus_per_node=2",
                      f"run.save_checkpoint={str(saved)!r}", "run.save_at_step=1")
    byte_identical_everywhere(report)
    assert report["checkpoint"]["files"] == 2 and (saved / "step-00000001" / "manifest.json").is_file()
    resumed = run_scenario(build({}, [*model, "run.steps=2", "parallel.dp=1", "parallel.pp=2",
                                      "cluster.gpus_per_node=2", f"run.resume={str(saved)!r}"]))
    assert resumed.report["verification"]["bit_exact"]
    back = tmp_path / "on_emulator"
    run_scenario(build({}, [*model, "run.steps=1", "parallel.dp=1", "parallel.tp=2", "cluster.gpus_per_node=2",
                            f"run.save_checkpoint={str(back)!r}"]))
    report = on_torch(*model, "run.steps=2", "parallel.dp=2", "parallel.zero=1", "cluster.gpus_per_node=2",
                      f"run.resume={str(back)!r}")
    byte_identical_everywhere(report)
    assert report["checkpoint"]["resumed"]["step"] == 1 and report["steps"] == 1


def test_pipeline_messages_scattered_and_gathered_on_gloo():
    """pp2 x tp2 without SP, Megatron's scatter/gather: each tp rank sends half a message, the next
    stage all-gathers it over tp (torch's all_gather_single): the emulator's bytes on gloo."""
    model = ModelConfig(layers=2, hidden=8, heads=4, ffn_hidden=8, seq=8, vocab=8, tied_head=False)
    data = TrainingConfig(model=model, global_batch=2, micro_batches=2, steps=2, precision="bf16")
    same_on_gloo(data, DeviceMesh(pp=2, tp=2), scatter_gather=True, schedule="1f1b")


@pytest.mark.parametrize("broken", [False, True])
def test_the_fast_bound_catches_a_swapped_shard_on_gloo(broken):
    """The torch kernel set in fast mode on gloo: the correct tp2 program is within the derived bound of
    one device; the one whose tp ranks compute each other's heads (tests/broken.py) is not."""
    from broken import swapped_tp
    from simcluster import report
    from simcluster.numerics import tolerance

    model = ModelConfig(layers=2, hidden=16, heads=4, ffn_hidden=32, seq=8, vocab=16, tied_head=False, dropout=0.1)
    data = TrainingConfig(model=model, global_batch=4, micro_batches=2, steps=2, precision="bf16")
    parallelism, mesh = Parallelism(data=data), DeviceMesh(tp=2)
    got = spawn(swapped_tp if broken else composed, parallelism, mesh=mesh, mode="fast", backend="gloo")
    outputs = assemble(got, [mesh.coords(r) for r in range(mesh.world_size)], parallelism)
    bounds = tolerance.training_bounds("bf16", model.layers, data.global_batch * model.seq)
    verdict = report.verification("fast", reference(data, "fast"), outputs, bounds)
    assert verdict["passed"] is (not broken), verdict


@pytest.mark.parametrize("layout", [
    pytest.param(("parallel.dp=2", "parallel.zero=3", "cluster.gpus_per_node=2"), marks=pytest.mark.slow),
    ("parallel.dp=1", "parallel.cp=2", "parallel.attention=ulysses", "model.arch=llama", "model.kv_heads=2",
     "cluster.gpus_per_node=2"),
    ("parallel.dp=1", "model.arch=llama", "model.kv_heads=2", "model.gqa=native", "cluster.gpus_per_node=1"),
])
def test_fused_attention_from_the_command_line(layout):
    """Without dropout the torch kernel set's attention is torch's fused one (SDPA); plain, Ulysses (which
    runs the core on whole sequences) and the kv heads as they are (SDPA's enable_gqa) agree with the
    emulator and one device within the bound."""
    within_the_fast_tolerance(on_torch(
        "run.steps=2", "model.dropout=0", "run.numerics=fast", "model.dtype=bf16", *layout, "model.layers=2",
        "model.hidden=8", "model.heads=4", "model.ffn_hidden=8", "model.seq=4", "model.vocab=8",
        "model.tied_head=false", "model.global_batch=4", "model.micro_batch=1"))


MOE = ("model.arch=llama", "model.tied_head=false", "model.moe_experts=4", "model.moe_top_k=2",
       "model.moe_aux_coeff=0.01", "model.layers=2", "model.hidden=8", "model.heads=2", "model.ffn_hidden=8",
       "model.seq=6", "model.vocab=10", "model.global_batch=4", "model.micro_batch=1")


def test_a_mixture_of_experts_from_the_command_line():
    """Routing reads the scores back to the host (as Megatron-Core reads its token counts) and gloo gives the
    emulator's bytes: dp2 x pp2 with capacity dropping and DeepSeek-V3's routing."""
    byte_identical_everywhere(on_torch(*SMALL, *MOE, "parallel.dp=2", "parallel.pp=2", "cluster.gpus_per_node=4",
                                       "model.moe_capacity_factor=1.0", "model.moe_scores=sigmoid",
                                       "model.moe_normalize=true", "model.moe_route_scale=2.5", "model.dtype=bf16"))


def test_a_mixture_of_experts_in_fast_mode_on_gloo():
    within_the_fast_tolerance(on_torch(*SMALL, *MOE, "run.numerics=fast", "model.dtype=bf16", "parallel.dp=2",
                                       "cluster.gpus_per_node=2"))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_parallelism_on_gloo(dispatcher):
    """ep 2 x dp 2 (4 ranks, each pair sharing out 4 experts): the all-to-all as gloo's all_to_all_single
    with uneven split sizes, or the all-gather dispatcher's gathers and reduce-scatters of exact partials,
    byte-identical to the emulator and to one device."""
    byte_identical_everywhere(on_torch(*SMALL, *MOE, "parallel.dp=4", "parallel.ep=2", "cluster.gpus_per_node=4",
                                       "model.moe_capacity_factor=1.0", f"parallel.moe_dispatcher={dispatcher}"))


def test_expert_parallelism_beside_tensor_parallelism_on_gloo():
    """tp 2 (sequence-parallel) x ep 2: each tp rank routes its own tokens, the balance loss and the selection
    bias sum them over tp, the experts' gradients over the tp ranks too; byte-identical on gloo."""
    byte_identical_everywhere(on_torch(*SMALL, *MOE, "parallel.dp=2", "parallel.ep=2", "parallel.tp=2",
                                       "parallel.sp=true", "cluster.gpus_per_node=4", "model.moe_scores=sigmoid",
                                       "model.moe_bias_rate=0.01", "parallel.zero=1"))


def test_dualpipes_overlap_with_expert_parallelism_on_gloo():
    """DualPipe's paired forward and backward passes run together (pipeline.together) on real process
    groups: one micro-batch's all-to-all in flight on gloo while the other's kernels run, each pair's
    messages sent after both; byte-identical to the emulator and to one device."""
    byte_identical_everywhere(on_torch(*SMALL, *MOE, "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                                       "parallel.schedule=dualpipe", "cluster.gpus_per_node=4",
                                       "model.global_batch=8"))

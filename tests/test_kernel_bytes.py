"""What a kernel moves, as the tensors it reads and writes are wide: a 16-bit run's fp32 tensors at 4 bytes an
element (the cross-entropy's upcast logits, the optimizer's master weights and moments), a cast at its input's
width and its output's, and no kernel where a stack launches none (a cast to the tensor's own dtype, the
gradient norm's flattening, the micro-batches' gradient accumulation under Megatron-LM's fusion)."""

import collections

import numpy as np
import pytest

from simcluster.config.imports import megatron, torchtitan
from simcluster.config.scenario import load
from simcluster.numerics.modes import make_ops
from simcluster.numerics.tensor import MetaTensor
from simcluster.run.runner import run_scenario

ROWS, VOCAB = 6, 40  # a micro-batch's tokens and a vocabulary: the logits' shape
N = ROWS * VOCAB


def _charged(mode="meta"):
    log = []
    return log, make_ops(mode, lambda name, work, nbytes: log.append((name, nbytes)), cost_dtype="bf16")


def test_a_16_bit_runs_fp32_logits_and_master_weights_move_4_bytes_an_element():
    """Megatron-LM's cross-entropy takes `logits.float()`: the upcast reads 2 bytes and writes 4 an element, and
    every pass over the fp32 logits after it moves 4 bytes an element read or written; AdamW reads an fp32
    weight, gradient and two moments and writes three of them: 28 bytes a parameter. The same kernels on
    16-bit tensors move 2 bytes an element. (Charged at the run's 2 bytes, the fp32 passes came to half.)"""
    log, ops = _charged()
    low = MetaTensor((ROWS, VOCAB), "bf16")
    wide = ops.cast(low, "fp32")
    row_max = ops.max(wide, -1)
    e = ops.attention_weights(wide, row_max)  # exp(logits - max): read, write
    ops.sum(e, -1, partial=True)  # read, a value a row written
    ops.cast(e, "bf16")  # the gradient back to the logits' dtype
    ops.attention_weights(low, ops.max(low, -1))
    assert log == [("cast", N * (2 + 4)), ("max", N * 4), ("attention_weights", 2 * N * 4), ("sum", (N + ROWS) * 4),
                   ("cast", N * (4 + 2)), ("max", N * 2), ("attention_weights", 2 * N * 2)]
    log.clear()
    master = MetaTensor((N,), "fp32")
    ops.adam(master, master, master, master, 1, lr=1e-3)
    assert log == [("adam", 7 * N * 4)]


def test_a_cast_to_its_own_dtype_is_no_kernel_and_one_into_a_buffer_is_a_copy():
    """torch's `.float()` of an fp32 tensor is the tensor: nothing launched, nothing charged. A cast written into a
    buffer the caller gives is a copy, charged as one."""
    log, ops = _charged()
    x = MetaTensor((N,), "fp32")
    assert ops.cast(x, "fp32") is x and log == []
    fast_log, fast = _charged("fast")
    values = np.arange(N, dtype=np.float32)
    assert fast.cast(values, "fp32") is values and fast_log == []
    into = np.zeros(N, dtype=np.float32)
    assert fast.cast(values, "fp32", out=into) is into and fast_log == [("cast", N * 8)]


def test_the_gradient_norm_reads_each_gradient_once():
    """torch's _foreach_norm and apex's multi_tensor_l2norm read each gradient once: one kernel of the gradient's
    bytes. (The exact sum of squares flattens each gradient first, for the numbers' sake: charged, that was a
    copy and a dot product reading the copy twice, four passes.)"""
    from simcluster.model.optimizer import square_sum

    log, ops = _charged()
    square_sum(ops, [MetaTensor((ROWS, VOCAB), "fp32"), MetaTensor((VOCAB,), "bf16")])
    assert log == [("grad_norm", N * 4), ("grad_norm", VOCAB * 2)]


SMALL = ["parallel.dp=2", "parallel.zero=1", "cluster.gpus_per_node=2", "run.steps=1", "model.layers=2",
         "model.dtype=bf16", "parallel.grads_fp32=true", "model.global_batch=8", "model.micro_batch=1"]  # 4 micro-batches


def _kernels(fusion, mode="meta", *extra):
    out = run_scenario(load(None, SMALL + [f"parallel.grad_accumulation_fusion={fusion}", f"run.numerics={mode}",
                                           *extra]), fold=False)
    return out, collections.Counter(e.name for e in out.result.trace.events if e.rank == 0)


def test_without_gradient_accumulation_fusion_each_micro_batch_adds_its_gradients_in_a_kernel():
    """Four micro-batches of four units (embed, two blocks, head): PyTorch's autograd adds the second, third and
    fourth micro-batches' gradients to the fp32 ones in a kernel each (12 adds), and DDP copies them into their
    bucket after the last (4 copies); Megatron-LM's weight-gradient GEMMs write into its buffer, adding, and no
    kernel is left of either."""
    fused, with_fusion = _kernels("true")
    plain, without = _kernels("false")
    more = without - with_fusion
    assert with_fusion - without == collections.Counter()
    assert sum(n for name, n in more.items() if name.endswith("/add")) == 4 * 3
    assert sum(n for name, n in more.items() if name.endswith("/flatten")) == 4
    assert all(name.startswith(("B1/", "B2/", "B3/")) for name in more)  # the backward passes after the first
    assert plain.report["step_time_ns"] > fused.report["step_time_ns"]


def assert_same_bytes(one, other):
    """Both runs bit-exact against one device, and each rank's losses and model states byte for byte alike."""
    assert one.report["verification"]["bit_exact"] and other.report["verification"]["bit_exact"]
    for a, b in zip(one.result.results, other.result.results, strict=True):
        assert [np.asarray(x).tobytes() for x in a["loss"]] == [np.asarray(x).tobytes() for x in b["loss"]]
        assert a["units"].keys() == b["units"].keys()
        for unit, states in a["units"].items():  # (params, grads, first_grads, adam_m, adam_v: a unit's flat buffers)
            for kind, tensor in states.items():
                assert np.asarray(tensor).tobytes() == np.asarray(b["units"][unit][kind]).tobytes(), (unit, kind)


def _megatron(*flags):
    doc, _ = megatron(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                       "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16", *flags], nodes=1,
                      gpus_per_node=8)
    return doc


def test_gradient_accumulation_fusion_changes_times_not_numbers():
    assert_same_bytes(_kernels("true", "exact")[0], _kernels("false", "exact")[0])


@pytest.mark.parametrize("flags,fused", [([], True), (["--no-gradient-accumulation-fusion"], False)])
def test_a_megatron_command_line_keeps_its_gradient_accumulation_fusion(flags, fused):
    assert _megatron(*flags)["parallel"]["grad_accumulation_fusion"] is fused


def test_a_torchtitan_job_runs_pytorchs_accumulation():
    doc, _ = torchtitan({"model": {"name": "llama3", "flavor": "8B"}}, nodes=1, gpus_per_node=8)
    assert doc["parallel"]["grad_accumulation_fusion"] is False


@pytest.mark.parametrize("fusion", ["true", "false"])
def test_meta_mode_charges_what_fast_mode_charges_where_the_widths_differ(fusion):
    """Charges now follow each tensor's own dtype, which meta mode's shapes must carry as the numbers do: a 16-bit
    step with fp32 gradients, logits and master weights times the same, kernel for kernel, in either mode. (Not
    clipped: whether the gradients' norm calls for the scaling pass is a number, which meta mode does not have.)"""
    (meta, _), (fast, _) = _kernels(fusion, "meta", "run.clip_grad=0"), _kernels(fusion, "fast", "run.clip_grad=0")
    assert [(e.rank, e.name, e.start, e.end) for e in meta.result.trace.events] == \
        [(e.rank, e.name, e.start, e.end) for e in fast.result.trace.events]


LOSS = ["parallel.dp=1", "parallel.tp=2", "parallel.sp=true", "cluster.gpus_per_node=2", "run.steps=1", "model.layers=1",
        "model.vocab=4096", "model.hidden=64", "model.heads=4", "model.seq=32", "model.dtype=bf16", "model.global_batch=2",
        "model.micro_batch=1"]
SHARE = 32 * 4096 // 2  # a micro-batch's logits on a tp rank: 32 tokens x half the vocabulary


def _loss(kernel, mode="meta"):
    return run_scenario(load(None, LOSS + [f"model.loss_kernel={kernel}", f"run.numerics={mode}"]), fold=False)


def test_a_fused_cross_entropy_keeps_the_16_bit_logits_and_reads_them_once_a_pass():
    """flash-attn's cross-entropy (LLM Foundry's default loss), Liger's and Megatron-LM's fused one: a kernel reads
    the 16-bit logits for the row maxima, one again for the exponentials' sums (a tensor-parallel sum between
    them), and one reads them a third time and writes their gradient; the backward makes the exponentials again,
    so the head keeps the 16-bit logits (2 bytes each) and a row maximum (4 bytes a token), not the fp32
    exponentials (4 bytes each), and no fp32 buffer is ever held: unfused, 13 bytes a logit at once."""
    unfused, fused = _loss("unfused"), _loss("fused")
    names = {kernel: collections.Counter(e.name.rpartition("/")[2] for e in run.result.trace.events
                                         if e.rank == 0 and ":head" in e.name) for kernel, run in
             (("unfused", unfused), ("fused", fused))}
    assert all(names["fused"][k] == 2 for k in ("cross_entropy_max", "cross_entropy", "cross_entropy_backward"))
    for unfused_only in ("cast", "max", "attention_weights", "attention_probs", "sub_one_hot", "scale"):
        assert names["unfused"][unfused_only] > 0 and unfused_only not in names["fused"], unfused_only
    peaks = {k: run.report["memory_peak_bytes"]["0"] for k, run in (("unfused", unfused), ("fused", fused))}
    assert peaks["unfused"]["activations"] - peaks["fused"]["activations"] == SHARE * (4 - 2) - 32 * 4
    assert peaks["unfused"]["temporaries"] == 13 * SHARE > peaks["fused"]["temporaries"]
    assert fused.report["step_time_ns"] < unfused.report["step_time_ns"]


def test_a_fused_cross_entropy_computes_the_same_bytes():
    assert_same_bytes(_loss("unfused", "exact"), _loss("fused", "exact"))


@pytest.mark.parametrize("flags,kernel", [([], "unfused"), (["--cross-entropy-loss-fusion"], "fused")])
def test_a_megatron_command_line_keeps_its_cross_entropy(flags, kernel):
    assert _megatron(*flags)["model"]["loss_kernel"] == kernel

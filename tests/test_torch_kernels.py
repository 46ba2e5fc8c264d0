"""The torch kernel set (gpu_backend/torch_ops.py) against fast mode's numpy kernels, operation by operation:
the counter-based random numbers bit for bit, everything else within the derived bound of one rounding
point (numerics/tolerance.py) — and a whole training step of every program family on torch's `meta`
device, which fails if any kernel or any line of a program reads host data."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")

from gpu_backend.torch_ops import TorchExactOps, TorchFastOps, torch_to_host  # noqa: E402
from simcluster.numerics.limbs import normalize  # noqa: E402
from simcluster.numerics.modes import make_ops  # noqa: E402
from simcluster.numerics.tensor import Partial  # noqa: E402
from simcluster.numerics.tolerance import bound  # noqa: E402

HOST, DEVICE = make_ops("fast"), TorchFastOps("cpu")


def both(*arrays):
    """numpy arrays, and the same values as torch tensors."""
    return arrays, tuple(DEVICE.xp.asarray(a) for a in arrays)


def values(x):
    if isinstance(x, Partial):
        x = x.finalize("fp32")
    return torch_to_host(x) if isinstance(x, torch.Tensor) else np.asarray(x)


def within_one_rounding(got, want, dtype, longest_sum):
    got, want = values(got).astype(np.float64), values(want).astype(np.float64)
    assert got.shape == want.shape
    finite = np.isfinite(want)
    assert (np.isfinite(got) == finite).all() and (got[~finite] == want[~finite]).all()  # masked scores: -inf
    got, want = got[finite], want[finite]
    error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert error <= bound(dtype, longest_sum, 1), (error, bound(dtype, longest_sum, 1))


def draw(name, shape, dtype, low=-1.0, high=1.0):
    return HOST.cast(HOST.uniform(7, name, shape, low=low, high=high), dtype)


def every_operation(HOST, DEVICE, dtype):
    """{name: (numpy result, torch result, longest sum)} for each operation of the kernel set."""
    b, s, h, a, v = 2, 8, 16, 4, 24
    (x, w, g, beta, y), (tx, tw, tg, tbeta, ty) = both(
        draw("x", (b, s, h), dtype), draw("w", (h, v), dtype), draw("g", (h,), dtype, 0.8, 1.2),
        draw("beta", (h,), dtype), draw("y", (b, s, h), dtype))
    q, k = draw("q", (b, a, s, h // a), dtype), draw("k", (b, a, s, h // a), dtype)
    (q, k), (tq, tk) = both(q, k)
    p, gr, m, vv = (HOST.uniform(3, n, (64,)) for n in "pgmv")
    vv = np.abs(vv)
    adam = HOST.adam(p, gr, m, vv, 3, lr=1e-3, weight_decay=0.1)
    tadam = DEVICE.adam(*(DEVICE.xp.asarray(t.copy()) for t in (p, gr, m, vv)), 3, lr=1e-3, weight_decay=0.1)
    clipped = HOST.adam(p, gr, m, vv, 3, lr=1e-3, grad_scale=np.float32(0.3))  # (torch's moments: in place)
    tclipped = DEVICE.adam(*(DEVICE.xp.asarray(t.copy()) for t in (p, gr, m, vv)), 3, lr=1e-3,
                           grad_scale=torch.tensor(0.3, dtype=torch.float32))
    ids = (np.arange(b * s).reshape(b, s) * 7) % v
    mask = np.tril(np.ones((s, s), bool))
    x2 = HOST.add(HOST.mul(x, x), g)  # positive
    cases = {  # name: (numpy result, torch result, longest sum)
        "matmul": (HOST.matmul(x, w), DEVICE.matmul(tx, tw), h),
        "matmul partial": (HOST.matmul(x, w, partial=True), DEVICE.matmul(tx, tw, partial=True), h),
        "einsum": (HOST.einsum("bsh,bsv->hv", x, HOST.matmul(x, w)), DEVICE.einsum("bsh,bsv->hv", tx, DEVICE.matmul(tx, tw)),
                   b * s),
        "sum": (HOST.sum(x, (0, 1)), DEVICE.sum(tx, (0, 1)), b * s),
        "add": (HOST.add(x, y), DEVICE.add(tx, ty), 1),
        "mul": (HOST.mul(x, y), DEVICE.mul(tx, ty), 1),
        "div": (HOST.div(x, HOST.add(y, HOST.cast(np.full(y.shape, 3, np.float32), dtype))),
                DEVICE.div(tx, DEVICE.add(ty, DEVICE.cast(DEVICE.xp.asarray(np.full(y.shape, 3, np.float32)), dtype))), 1),
        "scale": (HOST.scale(x, 1.0 / 0.9), DEVICE.scale(tx, 1.0 / 0.9), 1),
        "relu": (HOST.relu(x), DEVICE.relu(tx), 1),
        "gelu": (HOST.gelu(x), DEVICE.gelu(tx), 1),
        "gelu_backward": (HOST.gelu_backward(y, x), DEVICE.gelu_backward(ty, tx), 1),
        "silu": (HOST.silu(x), DEVICE.silu(tx), 1),
        "silu_backward": (HOST.silu_backward(y, x), DEVICE.silu_backward(ty, tx), 1),
        "layer_norm": (HOST.layer_norm(x, g, beta)[0], DEVICE.layer_norm(tx, tg, tbeta)[0], h),
        "layer_norm_backward": (HOST.layer_norm_backward(y, x, g, *HOST.layer_norm(x, g, beta)[1:])[0],
                                DEVICE.layer_norm_backward(ty, tx, tg, *DEVICE.layer_norm(tx, tg, tbeta)[1:])[0], h),
        "rms_norm": (HOST.rms_norm(x, g)[0], DEVICE.rms_norm(tx, tg)[0], h),
        "rms_norm_backward": (HOST.rms_norm_backward(y, x, g, HOST.rms_norm(x, g)[1])[0],
                              DEVICE.rms_norm_backward(ty, tx, tg, DEVICE.rms_norm(tx, tg)[1])[0], h),
        "attention_scores": (HOST.attention_scores(q, k, 0.5, mask), DEVICE.attention_scores(tq, tk, 0.5, DEVICE.causal(range(s), range(s))),
                             h // a),
        "softmax": (HOST.softmax(HOST.matmul(x, w)), DEVICE.softmax(DEVICE.matmul(tx, tw)), v),
        "log_softmax": (HOST.log_softmax(HOST.matmul(x, w)), DEVICE.log_softmax(DEVICE.matmul(tx, tw)), v),
        "embedding": (HOST.embedding(ids, w.T.copy(), row_offset=4), DEVICE.embedding(DEVICE.from_host(ids), tw.T.contiguous(), row_offset=4), 1),
        "embedding_backward": (HOST.embedding_backward(ids, y, v), DEVICE.embedding_backward(DEVICE.from_host(ids), ty, v), b * s),
        "gather_last": (HOST.gather_last(HOST.matmul(x, w), ids), DEVICE.gather_last(DEVICE.matmul(tx, tw), DEVICE.from_host(ids)), h),
        "sub_one_hot": (HOST.sub_one_hot(HOST.softmax(HOST.matmul(x, w)), ids, ids % 3 > 0),
                        DEVICE.sub_one_hot(DEVICE.softmax(DEVICE.matmul(tx, tw)), DEVICE.from_host(ids),
                                           DEVICE.from_host(ids % 3 > 0)), v),
        "heads": (HOST.heads(x, 4), DEVICE.heads(tx, 4), 1),
        "merge_heads": (HOST.merge_heads(q), DEVICE.merge_heads(tq), 1),
        "repeat": (HOST.repeat(q, 2, 1), DEVICE.repeat(tq, 2, 1), 1),
        "cast": (HOST.cast(x, "fp16"), DEVICE.cast(tx, "fp16"), 1),
        "flat": (HOST.flat([x, y]), DEVICE.flat([tx, ty]), 1),
        "pad": (HOST.pad(HOST.flat([x]), 7), DEVICE.pad(DEVICE.flat([tx]), 7), 1),
        "exp": (HOST.exp(x), DEVICE.exp(tx), 1),
        "log": (HOST.log(x2), DEVICE.log(DEVICE.add(DEVICE.mul(tx, tx), tg)), 1),
        "adam param": (adam[0], tadam[0], 4),
        "adam m": (adam[1], tadam[1], 4),
        "adam v": (adam[2], tadam[2], 4),
        "adam clipped": (clipped[0], tclipped[0], 4),
    }
    for name, (_, got, _) in cases.items():
        assert isinstance(got if not isinstance(got, Partial) else got.limbs, torch.Tensor), name
    return cases


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_operation_agrees_with_fast_mode_within_one_rounding(dtype):
    for name, (want, got, n) in every_operation(HOST, DEVICE, dtype).items():
        within_one_rounding(got, want, dtype, n)


@pytest.mark.parametrize("ops", [HOST, make_ops("exact"), DEVICE, TorchExactOps("cpu")],
                         ids=["numpy", "numpy-exact", "torch", "torch-exact"])
@pytest.mark.parametrize("keep", [None, "some"])
def test_the_cross_entropys_gradient_is_softmax_less_the_one_hot_byte_for_byte(ops, keep):
    """sub_one_hot (one at each row's target taken away, no one-hot tensor made) gives the bytes of the
    one-hot form the single-device model keeps, where `keep` says which rows' targets are this rank's."""
    rng = np.random.default_rng(3)
    p = ops.softmax(ops.from_host(rng.standard_normal((2, 5, 11)).astype(np.float32)))
    ids = rng.integers(0, 11, (2, 5))
    mine = None if keep is None else ids % 2 == 0
    one_hot = ops.one_hot(ops.from_host(ids), 11, p)
    if mine is not None:
        one_hot = ops.zero_where(ops.from_host(mine)[..., None], one_hot)
    got = ops.sub_one_hot(p, ops.from_host(ids), None if mine is None else ops.from_host(mine))
    assert host_bytes(got) == host_bytes(ops.sub(p, one_hot))
    assert host_bytes(got) != host_bytes(p)


@pytest.mark.parametrize("ops", [HOST, DEVICE], ids=["numpy", "torch"])
def test_adam_writes_a_donated_parameter_and_no_other(ops):
    """Ops.adam: the old parameter is left as it was unless donated; donated, the same tensor holds the
    new weights, byte for byte those of the undonated step. A clipping `grad_scale` is the step of the
    scaled gradient (scale, then adam), byte for byte."""
    xp = ops.xp
    p, g, m, v = (xp.asarray(HOST.uniform(5, n, (300,))) for n in "pgmv")
    v = xp.asarray(np.abs(HOST.xp.to_host(v)) if ops is HOST else torch.abs(v))

    def fresh():
        return [xp.asarray(np.array(xp.to_host(t))) for t in (p, g, m, v)]

    before, held = xp.to_host(p).tobytes(), fresh()
    kept = ops.adam(*held, 2, lr=1e-2, weight_decay=0.1)
    given = fresh()
    donated = ops.adam(*given, 2, lr=1e-2, weight_decay=0.1, donate=True)
    assert donated[0] is given[0] and xp.to_host(donated[0]).tobytes() == xp.to_host(kept[0]).tobytes()
    assert xp.to_host(held[0]).tobytes() == before and xp.to_host(kept[0]).tobytes() != before
    coefficient = xp.asarray(np.float32(0.37))
    a, b = fresh(), fresh()
    clipped = ops.adam(*a, 2, lr=1e-2, grad_scale=coefficient)
    scaled = ops.adam(b[0], ops.scale(b[1], coefficient), b[2], b[3], 2, lr=1e-2)
    for x, y in zip(clipped, scaled):
        assert xp.to_host(x).tobytes() == xp.to_host(y).tobytes()
    assert xp.to_host(clipped[0]).tobytes() != xp.to_host(kept[0]).tobytes()


@pytest.mark.parametrize("ops", [HOST, DEVICE], ids=["numpy", "torch"])
def test_a_16_bit_gradient_goes_to_its_all_reduce_in_16_bits(ops):
    """A weight gradient (a GEMM's fp32-accumulated partial) retagged to bf16 on its way to the data-parallel
    all-reduce holds bf16: its flat bucket is half an fp32 one's bytes on the wire, as the emulator charges
    it, and two of them add as bf16 adds (the sum rounded once to bf16), as a bf16 all-reduce adds them."""
    xp = ops.xp
    a, b = (ops.cast(xp.asarray(HOST.uniform(9, n, (6, 40))), "bf16") for n in "ab")
    grads = [ops.matmul(a, ops.transpose(b), partial=True) for _ in range(2)]
    tagged = [ops.retag(g, "bf16") for g in grads]
    for g, t in zip(grads, tagged):
        assert xp.name(t.limbs.dtype) == "bf16"
        assert xp.to_host(t.finalize("bf16")).tobytes() == xp.to_host(g.finalize("bf16")).tobytes()
    bucket = ops.flat(tagged)
    assert bucket.limbs.shape == (72, 1) and xp.name(bucket.limbs.dtype) == "bf16"
    total = ops.add_partial(tagged[0], tagged[1]).finalize("bf16")
    once = (np.asarray(xp.to_host(tagged[0].finalize("fp32")), np.float64)
            + np.asarray(xp.to_host(tagged[1].finalize("fp32")), np.float64))  # exact: bf16 + bf16 in fp64
    assert xp.to_host(total).tobytes() == HOST.cast(once.astype(np.float32), "bf16").tobytes()


def test_a_bf16_gemm_is_the_cpus_own_where_it_has_matrix_tiles():
    """On a CPU with AMX tiles a bf16 matmul is oneDNN's native bf16 GEMM, byte for byte (6x the widened
    fp32 GEMM on this machine), and a partial one (fp32 out) the fp32 GEMM allowed to use the tiles (2x);
    without them, the widened fp32 GEMM. All are within one rounding of fast mode on numpy (test above)."""
    from gpu_backend.torch_ops import CPU_BF16_TILES

    a = DEVICE.xp.asarray(draw("a", (64, 4096), "bf16"))
    b = DEVICE.xp.asarray(draw("b", (4096, 80), "bf16"))
    native, widened = torch.matmul(a, b), (a.float() @ b.float()).bfloat16()
    assert not torch.equal(native, widened)  # (the shapes are chosen so that the two differ)
    got = DEVICE.matmul(a, b)
    assert torch.equal(got, native if CPU_BF16_TILES else widened)
    assert CPU_BF16_TILES == bool(torch.cpu._is_amx_tile_supported())
    setting = torch.backends.mkldnn.matmul
    before = setting.fp32_precision
    partial = DEVICE.matmul(a, b, partial=True).limbs[..., 0]
    assert setting.fp32_precision == before  # (no later fp32 GEMM rounds its inputs)
    widened = a.float() @ b.float()
    setting.fp32_precision = "bf16"
    try:
        tiles = a.float() @ b.float()
    finally:
        setting.fp32_precision = before
    assert not CPU_BF16_TILES or not torch.equal(tiles, widened)  # (two orders of summation: they differ)
    assert partial.dtype == torch.float32 and torch.equal(partial, tiles if CPU_BF16_TILES else widened)
    exact = a.double() @ b.double()  # bf16 products are exact in fp32: both are fp32 sums of the same terms
    bound = 4096 * 2.0 ** -24 * (a.double().abs() @ b.double().abs())
    assert bool(((partial.double() - exact).abs() <= bound).all())


def host_bytes(x):
    return torch_to_host(x.limbs if isinstance(x, Partial) else x).tobytes() if isinstance(
        x.limbs if isinstance(x, Partial) else x, torch.Tensor) else np.asarray(
        x.limbs if isinstance(x, Partial) else x).tobytes()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("looks", [True, False])
def test_exact_mode_on_torch_is_the_emulators_byte_for_byte(dtype, looks):
    """Exact mode's limbs, sliced float64 GEMMs and transcendentals on torch give numpy's bytes, partial
    sums' limbs included; also where the namespace does not look whether its carries are done (as on a GPU,
    where looking would wait for it: arrays.py's cheap_truth)."""
    device = TorchExactOps("cpu")
    device.xp.cheap_truth = looks
    for name, (want, got, _) in every_operation(make_ops("exact"), device, dtype).items():
        assert host_bytes(got) == host_bytes(want), name
    # (a carry that ripples up every digit, one a round: the operations above take a round or two)
    ripple = np.array([[2**32, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, -1], [5, -1, 0, 0, 0, 0]], np.int64)
    want = np.array([[0, 0, 0, 0, 0, 0], [5] + [2**32 - 1] * 4 + [-1]], np.int64)  # (the same values, in range)
    assert host_bytes(normalize(device.xp.asarray(ripple), device.xp)) == normalize(ripple).tobytes() == want.tobytes()


def test_a_sqrt_that_is_not_correctly_rounded_is_caught():
    """The byte comparison can fail: torch's own fp32 sqrt on the CPU (not correctly rounded) changes
    layer norms and Adam's updates."""
    broken = TorchExactOps("cpu")
    broken.xp.correctly_rounded = False
    x = make_ops("exact").uniform(0, "x", (4096,), low=0.0, high=1e3)
    assert torch_to_host(broken.xp.sqrt(broken.xp.asarray(x))).tobytes() != np.sqrt(x).tobytes()


@given(st.tuples(st.integers(1, 5), st.integers(1, 7)), st.tuples(st.integers(0, 9), st.integers(0, 9)),
       st.integers(0, 2**40), st.sampled_from(["attn.0", "resid_mlp.3", "wte"]))
def test_the_random_numbers_are_numpys_bit_for_bit(shape, offset, seed, stream):
    full = (shape[0] + offset[0], shape[1] + offset[1] + 3)
    want = HOST.uniform(seed, stream, shape, offset=offset, full_shape=full, low=-0.5, high=2.0)
    got = DEVICE.uniform(seed, stream, shape, offset=offset, full_shape=full, low=-0.5, high=2.0)
    assert torch_to_host(got).tobytes() == want.tobytes()
    keep = DEVICE.dropout_keep(seed, stream, shape, 0.3, offset=offset, full_shape=full)
    assert torch_to_host(keep).tobytes() == HOST.dropout_keep(seed, stream, shape, 0.3, offset=offset,
                                                               full_shape=full).tobytes()


def test_a_broken_random_stream_is_caught():
    """The bit comparison above can fail: a logical shift done as an arithmetic one changes the bits."""
    class Broken(type(DEVICE.xp)):
        @staticmethod
        def _shr(z, k):
            return z >> k
    broken = Broken("cpu")
    want = HOST.uniform(1, "x", (64,))
    assert torch_to_host(broken.uniform(1, "x", (64,))).tobytes() != want.tobytes()


def test_clipping_on_the_device_never_reads_the_coefficient_back():
    """The host decides whether to clip by the coefficient's value; the device always scales by min(1, c),
    which gives the same bytes (scaling by 1 is exact)."""
    g = HOST.uniform(0, "g", (32,))
    for max_norm in (0.1, 100.0):
        squares = HOST.einsum("i,i->", g, g, partial=True)
        c, clips = HOST.clip_coefficient(squares, max_norm, 1e-6)
        want = HOST.scale(g, c) if clips else g
        tg = DEVICE.xp.asarray(g)
        tc, always = DEVICE.clip_coefficient(DEVICE.einsum("i,i->", tg, tg, partial=True), max_norm, 1e-6)
        assert always and isinstance(tc, torch.Tensor)
        within_one_rounding(DEVICE.scale(tg, tc), want, "fp32", 32)


# -- a whole training step on the meta device ------------------------------------------------------------

FAMILIES = {  # every program family, and the GPT's options that add kernels (dropout, recompute, mixed
    # precision, clipping, ZeRO-3's flat buffers, offload's copies): one rank, all of it on `meta`
    "gpt": ("model.dropout=0.1", "model.dtype=bf16", "parallel.recompute=selective", "parallel.zero=3",
            "run.clip_grad=1.0"),
    "gpt-fp16-full": ("model.dtype=fp16", "parallel.recompute=full", "model.tied_head=true"),
    "llama": ("model.arch=llama", "model.kv_heads=2", "model.tied_head=false", "model.dropout=0.1",
              "model.dtype=bf16"),
    "mlp": ("run.program=mlp",),
    "collectives": ("run.program=collectives",),
    "allreduce": ("run.program=allreduce",),
}
ONE_RANK = ("parallel.dp=1", "cluster.gpus_per_node=1", "model.layers=2", "model.hidden=16", "model.heads=4",
            "model.ffn_hidden=32", "model.seq=8", "model.vocab=16", "model.global_batch=2", "run.steps=2",
            "run.numerics=fast")


@pytest.fixture(scope="module")
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def step_on(device, family, mode="fast"):
    from gpu_backend.backend import measured
    from simcluster.run.job import job_of
    from simcluster.config.scenario import load

    job = job_of(load(None, [*ONE_RANK, *FAMILIES[family], f"run.numerics={mode}"]), fold=False)
    return measured(job.program, job.args, job.mesh, mode=mode, device=torch.device(device)).result


def leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from leaves(v)
    elif isinstance(value, Partial):
        yield value.limbs
    elif value is not None and not isinstance(value, (int, float, str)):
        yield value


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_whole_step_of_every_family_runs_on_the_meta_device(family, one_process_group):
    """torch's meta device has shapes and no data: numpy cannot read it (np.asarray raises), nor can
    float() or a branch on a value. A whole training step on it shows that every kernel ran on the
    device and nothing went through the host; the same step on the CPU gives numbers of the same shapes."""
    on_meta = list(leaves(step_on("meta", family)))
    on_cpu = list(leaves(step_on("cpu", family)))
    assert on_meta and all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in on_meta)
    assert [tuple(t.shape) for t in on_meta] == [tuple(np.shape(a)) for a in on_cpu]


def test_a_kernel_that_reads_host_data_fails_on_the_meta_device(one_process_group, monkeypatch):
    """The meta run can fail: a head split written with numpy (as the program once had it) raises there."""
    from simcluster.numerics.ops import Ops

    monkeypatch.setattr(Ops, "heads", lambda self, x, d: np.ascontiguousarray(
        np.asarray(x).reshape(x.shape[0], x.shape[1], -1, d).transpose(0, 2, 1, 3)))
    with pytest.raises(Exception, match="meta"):
        step_on("meta", "gpt")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exact_mode_runs_without_numpy_reading_a_tensor(family, one_process_group):
    """Exact mode cannot run on `meta` (it reads booleans back), so the backend refuses numpy's reading
    of a tensor while the program runs, on every device, as a GPU refuses it for a CUDA tensor: a whole
    exact step of every family on the CPU under that refusal."""
    assert list(leaves(step_on("cpu", family, mode="exact")))


def test_a_partial_that_lost_its_namespace_is_caught_on_the_cpu(one_process_group, monkeypatch):
    """The bug an H100 found and every CPU test missed: a 16-bit gradient's partial retagged without its
    namespace (numpy's), whose concatenation then read device tensors through numpy."""
    from simcluster.numerics.flat import FlatBuffers
    from simcluster.numerics.tensor import dtype_name

    def retag_losing_the_namespace(self, p, dtype):
        return Partial(p.limbs, dtype) if isinstance(p, Partial) else self.xp.astype(p, dtype_name(dtype))
    monkeypatch.setattr(FlatBuffers, "retag", retag_losing_the_namespace)
    with pytest.raises(TypeError, match="numpy read a cpu tensor"):
        step_on("cpu", "gpt", mode="exact")


@pytest.mark.parametrize("spec", ["bsh,bsk->hk", "bsf,bsh->fh", "bask,bakd->basd", "bask,basd->bakd",
                                  "basd,bakd->bask", "tv,th->vh", "i,i->", "ij,jk->ik"])
def test_an_einsum_is_one_batched_matrix_product(spec):
    """`contract` (how a GPU writes a 16-bit einsum's fp32 partial sums: bmm's out_dtype) gives einsum's
    values, byte for byte on small integers (every sum exact); on `meta`, the fp32 output of bf16 inputs
    in einsum's shape."""
    from gpu_backend.torch_ops import contract

    inputs, _ = spec.split("->")
    letters = sorted(set(inputs) - {","})
    size = {c: 2 + i for i, c in enumerate(letters)}  # (every index its own length: a wrong permutation shows)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-4, 5, [size[c] for c in operand], generator=gen).float() for operand in inputs.split(","))
    want = torch.einsum(spec, a, b)
    got = contract(spec, a, b, torch.bmm)
    assert got.shape == want.shape and torch.equal(got, want)
    on_meta = contract(spec, a.to("meta", torch.bfloat16), b.to("meta", torch.bfloat16),
                       lambda x, y: torch.bmm(x, y, out_dtype=torch.float32))
    assert on_meta.dtype == torch.float32 and on_meta.shape == want.shape


def test_an_einsum_summing_one_operand_alone_is_refused():
    from gpu_backend.torch_ops import contract

    with pytest.raises(ValueError, match="one operand alone"):
        contract("ij,jk->k", torch.ones(2, 3), torch.ones(3, 4), torch.bmm)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_fused_attention_agrees_with_the_two_pass_core(dtype):
    """torch's scaled_dot_product_attention (the kernel set's fused attention, used where there is no
    dropout) against the model's two-pass core in numpy's fast mode: output and dq, dk, dv within the
    derived bound of a softmax's reductions (the keys)."""
    from simcluster.model.gpt import GPT, ModelConfig, Slice

    cfg = ModelConfig(hidden=32, heads=4, seq=16, causal=True)
    q, k, v, dout = (draw(n, (2, 4, 16, 8), dtype) for n in ("q", "k", "v", "dout"))
    host, device = GPT(HOST, cfg), GPT(DEVICE, cfg)
    want = host.attention_core(q, k, v, 0, 0, Slice(0, 2))
    got = device.attention_core(*(DEVICE.xp.asarray(t) for t in (q, k, v)), 0, 0, Slice(0, 2))
    assert "flash" in got and "e" not in got  # the fused kernel ran, no scores kept
    within_one_rounding(got["out"], want["out"], dtype, 16)
    grads = device.attention_backward(DEVICE.xp.asarray(dout), got)
    wants = host.attention_backward(dout, want | {"q": q, "k": k, "v": v})
    for g, w in zip(grads, wants):
        within_one_rounding(g, w, dtype, 16)


def test_the_fused_attention_is_charged_as_the_emulators_flash_kernel():
    """Where the torch kernel set runs torch's fused attention, it records the kernel the emulator charges
    for the same core (model/flash.py: one flash_attention forward, one backward, the same FLOPs and
    bytes), so that calibrate, which divides a kernel's charged bytes by its measured time, measures the
    rate the emulator times it at. Before, the fused kernel recorded nothing: its time went uncharged."""
    from simcluster.model.gpt import GPT, ModelConfig, Slice

    cfg = ModelConfig(hidden=32, heads=4, seq=16, causal=True)
    q, k, v, dout = (draw(n, (2, 4, 16, 8), "fp32") for n in ("q", "k", "v", "dout"))
    host_log, device_log = [], []
    host = GPT(make_ops("fast", lambda *r: host_log.append(r)), cfg)
    ops = TorchFastOps("cpu", lambda *r: device_log.append(r))
    device = GPT(ops, cfg)
    want = host.attention_core(q, k, v, 0, 0, Slice(0, 2))
    host.attention_backward(dout, want | {"q": q, "k": k, "v": v})
    got = device.attention_core(*(ops.xp.asarray(t) for t in (q, k, v)), 0, 0, Slice(0, 2))
    device.attention_backward(ops.xp.asarray(dout), got)
    flash = [r for r in host_log if r[0].startswith("flash_attention")]
    assert [r[0] for r in flash] == ["flash_attention", "flash_attention_backward"]
    assert device_log == flash  # (name, FLOPs, bytes): the same kernels, nothing else recorded


def test_a_timed_kernel_set_puts_each_calls_time_on_the_kernels_it_recorded():
    """calibrate's step profile (gpu_backend/calibrate.py `TimedKernels`): each call the program makes is timed
    once (a kernel calling others is one kernel), a fused region is the one kernel it records (its
    enclosed ops are not charged apart), and a call that records two kernels shares its time between
    them by the bytes each is charged."""
    from gpu_backend.step_profile import TimedKernels

    class TwoKernels(TorchFastOps):
        def norm_and_scale(self, x):  # (one call, two kernels: a norm's and a scale's)
            return self.scale(self.layer_norm(x, x[0], x[0])[0], 0.5)

    timed = TimedKernels()
    ops = timed.wrap(TwoKernels("cpu"))
    x = ops.xp.asarray(np.linspace(-2, 2, 4096, dtype=np.float32).reshape(64, 64))
    ops.gelu(x)
    with ops.fused("bias_gelu", nbytes=3 * x.numel() * 4):
        ops.gelu(ops.add(x, x))
    ops.norm_and_scale(x)
    p, g, m, v = (ops.xp.asarray(np.full(1024, f, np.float32)) for f in (1.0, 0.5, 0.0, 0.0))
    ops.adam(p, g, m, v, 1, lr=1e-3, grad_scale=0.5, donate=True)  # (a clipped gradient's scaling is Adam's)
    assert timed.calls == {"gelu": 1, "bias_gelu": 1, "layer_norm": 1, "scale": 1, "adam": 2}  # none inside bias_gelu
    assert timed.nbytes["bias_gelu"] == 3 * 4096 * 4
    assert all(t > 0 for t in timed.seconds.values())
    share = timed.seconds["layer_norm"] / (timed.seconds["layer_norm"] + timed.seconds["scale"])
    assert share == pytest.approx(timed.nbytes["layer_norm"] / (timed.nbytes["layer_norm"] + timed.nbytes["scale"]))


def test_a_step_profile_charges_a_16_bit_step_as_the_emulator_charges_it():
    """calibrate's step profile gives each kernel the rate it reached as the bytes the emulator charges it over
    its time; in a bf16 run the emulator charges an elementwise kernel 2 bytes an element. The step's kernel
    set charged 4 (fp32's) whatever the run's dtype, so every bf16 rate came out twice what the kernels reach
    and a bf16 prediction 14-30 % short of the run (calibrated_prediction.py)."""
    from gpu_backend.processes import in_processes
    from gpu_backend.step_profile import timed_steps

    fp32, bf16 = (in_processes(timed_steps, (dtype, 1), 1, "gloo", timeout_s=300)[0] for dtype in ("fp32", "bf16"))
    # (the same kernels, but casts: a 16-bit step's weights rounded from the master and its head's logits cast to fp32
    # for the cross-entropy and its gradient back; an fp32 step's calls of cast change nothing and launch nothing)
    assert "cast" not in fp32.calls and "<cast>" in fp32.calls and bf16.calls["cast"] > 0
    assert {k: n for k, n in fp32.calls.items() if k != "<cast>"} == {k: n for k, n in bf16.calls.items() if k != "cast"}
    for name in ("layer_norm", "layer_norm_backward", "rms_norm", "gelu_backward", "swiglu_backward", "add"):
        assert bf16.nbytes[name] * 2 == fp32.nbytes[name], name
    assert bf16.nbytes["sub_one_hot"] == fp32.nbytes["sub_one_hot"]  # (on the fp32 logits in both)


def test_a_step_profile_takes_each_kernels_median_rate(monkeypatch):
    """One profile's call preempted once is a kernel's time several times over on a shared machine: the rate
    is the median of the profiles' (here 1 s, 10 s and 2 s for 4 GB: 2 GB/s, not a mean's 0.92)."""
    from gpu_backend import step_profile

    times = iter([1.0, 10.0, 2.0])

    def profile(device, dtype, ranks, hidden):
        timed = step_profile.TimedKernels()
        timed.seconds, timed.nbytes, timed.calls = {"gelu": next(times), "matmul": 1.0}, {"gelu": 4e9, "matmul": 1.0}, \
            {"gelu": 1, "matmul": 1}
        return timed
    monkeypatch.setattr(step_profile, "timed_steps", profile)
    rates, _ = step_profile.step_rates(torch.device("cpu"), 0.0, ("bf16",), 1, repeats=3, widths=(512,))
    assert [(k.name, k.dtype, k.gbyte_per_s) for k in rates] == [("gelu", "bf16", 2.0)]  # (GEMMs: the grid's)


def test_a_step_profile_rates_each_kernel_at_each_width(monkeypatch):
    """A kernel's rate depends on its size (the fused attention at head dimension 32 ran 2.1x slower than the
    one width's rate charged it, at 128 0.6x): the profile is taken at two widths, and each kernel's entry
    says the bytes it was charged a call there (the step's bytes over its calls)."""
    from gpu_backend import step_profile

    def profile(device, dtype, ranks, hidden):
        timed = step_profile.TimedKernels()
        calls = 3 if hidden == 256 else 2
        timed.seconds, timed.nbytes, timed.calls = {"gelu": 1.0}, {"gelu": hidden * 1e6}, {"gelu": calls}
        return timed
    monkeypatch.setattr(step_profile, "timed_steps", profile)
    rates, _ = step_profile.step_rates(torch.device("cpu"), 0.0, ("fp32",), 1, repeats=1, widths=(256, 1024))
    assert [(k.name, k.gbyte_per_s, k.nbytes) for k in rates] == [("gelu", 0.256, 256e6 / 3), ("gelu", 1.024, 512e6)]


def test_a_step_profile_measures_the_calls_that_record_no_kernel(monkeypatch):
    """The kernel set's calls that record no kernel (views, a gradient's rounding into its 16-bit buffer) take
    time on a CPU that the cost model charges nothing for: the profile measures it as a share of the kernels'
    time (the median over its profiles: 0.25, 0.5, 1.0 -> 0.5)."""
    from gpu_backend import step_profile

    shares = iter([0.25, 0.5, 1.0])

    def profile(device, dtype, ranks, hidden):
        timed = step_profile.TimedKernels()
        timed.charged, timed.uncharged = 2.0, 2.0 * next(shares)
        return timed
    monkeypatch.setattr(step_profile, "timed_steps", profile)
    assert step_profile.step_rates(torch.device("cpu"), 0.0, ("fp32",), 1, repeats=3, widths=(512,)) == ([], {"fp32": 0.5})

    class Kernels:  # a kernel set of two calls: one records a kernel, one does not
        def __init__(self):
            self._record = lambda name, work, nbytes: None

        def gelu(self):
            self._record("gelu", 1, 8.0)

        def view(self):
            pass
    timed = step_profile.TimedKernels()
    ops = timed.wrap(Kernels())
    ops.gelu(), ops.view(), ops.view()
    assert timed.calls == {"gelu": 1, "<view>": 2} and timed.charged > 0 and timed.uncharged > 0


def test_a_gather_along_the_first_axis_is_the_buffer_it_arrived_in():
    """The torch backend joins an all-gather's (and an all-to-all's) received parts along the first axis
    as a view of the receive buffer, no copy (FSDP's gathered weights); along another axis, one copy. Both
    are the parts concatenated, byte for byte."""
    from gpu_backend.backend import _joined

    parts = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # two ranks' (3, 4) tensors
    first, second = _joined(parts, 0), _joined(parts, 1)
    assert torch.equal(first, torch.cat(list(parts), 0)) and torch.equal(second, torch.cat(list(parts), 1))
    assert first.data_ptr() == parts.data_ptr() and second.data_ptr() != parts.data_ptr()


@pytest.mark.parametrize("family", [(), ("model.arch=llama", "model.kv_heads=2"), ("model.dtype=fp32", "parallel.zero=3")],
                         ids=["gpt", "llama", "gpt-fp32-zero3"])
def test_a_steps_peak_on_torch_is_the_predicted_peak(family, one_process_group):
    """What a GPU's torch.cuda.max_memory_allocated counts, taken on the CPU (the peak of the live tensors,
    torch's MemTracker over a 3-step run) against the emulator's predicted peak, within 4 %, on steps whose
    peak is the head's (a vocabulary 32x the hidden size). An H200 had measured 42 GiB where 30 were
    predicted for a 1.2B GPT: the initial weights kept beside their flat copies, a one-hot of the targets as
    wide as the logits (int64 on torch), a scaled-gradient buffer kept from step to step, a step's gradients
    held through the next, and none of the cross-entropy's vocabulary-wide buffers charged."""
    from dataclasses import replace

    from torch.distributed._tools.mem_tracker import MemTracker

    from gpu_backend.backend import measured
    from simcluster.config.scenario import load
    from simcluster.run.job import job_of
    from simcluster.run.runner import run_scenario

    sc = load(None, ["model.hidden=256", "model.layers=2", "model.heads=8", "model.ffn_hidden=1024", "model.seq=64",
                     "model.vocab=8192", "model.global_batch=8", "model.dtype=bf16", "model.tied_head=false",
                     "model.dropout=0", "parallel.dp=1", "cluster.gpus_per_node=1", "run.numerics=fast",
                     "run.verify=false", "run.steps=3", "run.clip_grad=1.0", *family])
    job = job_of(sc, fold=False)
    tracker = MemTracker()
    with tracker:
        measured(job.program, job.args, job.mesh, mode="fast", device=torch.device("cpu"))
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    predicted = run_scenario(replace(sc, run=replace(sc.run, numerics="meta")), fold=False, trace=False).report["memory"]["peak_bytes"]
    assert abs(peak / predicted - 1) < 0.04, (peak, predicted)

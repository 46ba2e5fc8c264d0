"""`simcluster import`: Megatron-LM's arguments and torchtitan's job files as scenarios that run, every
option that could not be mapped named; `keys` finds a key by either tool's name; `run --write-scenario`
writes the scenario as run."""

from pathlib import Path

import pytest

from simcluster.cli import main
from simcluster.config.imports import LLAMA3, megatron, torchtitan
from simcluster.config.scenario import load

DATA = Path(__file__).parent / "data"
# Megatron-LM's GPT-3 175B example (examples/gpt3/train_gpt3_175b_distributed.sh): its model, batch and
# parallelism arguments, and some it has that simcluster has no setting for
GPT3_175B = ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --num-layers 96 --hidden-size 12288 "
             "--num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 "
             "--global-batch-size 1536 --train-samples 146484375 --lr-decay-samples 126953125 --lr 6.0e-5 "
             "--min-lr 6.0e-6 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 "
             "--adam-beta2 0.95 --init-method-std 0.006 --fp16").split()


def test_megatrons_gpt3_example_is_imported_with_every_value_and_each_unmapped_option_named():
    doc, notes = megatron(GPT3_175B, nodes=16, gpus_per_node=8)
    m, p, r = doc["model"], doc["parallel"], doc["run"]
    assert (m["layers"], m["hidden"], m["heads"], m["seq"], m["micro_batch"], m["global_batch"]) == \
        (96, 12288, 96, 2048, 1, 1536)
    assert (m["ffn_hidden"], m["dtype"], m["arch"]) == (4 * 12288, "fp16", "gpt")  # (Megatron's defaults)
    assert (p["tp"], p["pp"], p["dp"], p["zero"], p["schedule"], p["sp"]) == (8, 16, 1, 0, "1f1b", False)
    assert (r["lr"], r["clip_grad"], r["weight_decay"]) == (6.0e-5, 1.0, 0.1)
    named = " ".join(notes)
    for option in ("--train-samples", "--min-lr", "--adam-beta1", "--init-method-std", "--max-position-embeddings"):
        assert option in named
    assert "vocabulary" in named
    # its tied embedding across 16 stages (Megatron's embedding group) is kept tied; fp16 reduces 16-bit
    # gradients (Megatron sets --accumulate-allreduce-grads-in-fp32 only for bf16)
    assert m["tied_head"] is True and p["grads_fp32"] is False


@pytest.mark.parametrize("flags, fp32", [("--bf16", True), ("--bf16 --grad-reduce-in-bf16", False), ("--fp16", False),
                                         ("--fp16 --accumulate-allreduce-grads-in-fp32", True), ("", False)])
def test_megatrons_gradient_dtype_is_imported_as_its_arguments_set_it(flags, fp32):
    """Megatron-LM's arguments.py: bf16 accumulates and all-reduces gradients in fp32 unless
    --grad-reduce-in-bf16; fp16 only with --accumulate-allreduce-grads-in-fp32; fp32 trains in fp32."""
    base = "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1 " \
           "--global-batch-size 8"
    doc, _ = megatron((base + " " + flags).split(), nodes=1, gpus_per_node=8)
    assert doc["parallel"]["grads_fp32"] is fp32


@pytest.mark.parametrize("flags, want", [("", (False, False, True)), ("--tp-comm-overlap", (True, False, True)),
                                         ("--tp-comm-overlap --overlap-param-gather", (True, True, True)),
                                         ("--no-async-tensor-model-parallel-allreduce", (False, False, False)),
                                         ("--tp-comm-overlap --no-async-tensor-model-parallel-allreduce",
                                          (True, False, True))])
def test_megatrons_overlaps_are_imported(flags, want):
    """--tp-comm-overlap (Transformer Engine's userbuffers), --overlap-param-gather, and the async
    column-parallel backward Megatron-LM runs unless told not to (and under --tp-comm-overlap whatever it
    is told: Transformer Engine's bulk overlaps): flags, no value."""
    base = "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --num-layers 2 " \
           "--hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1 --global-batch-size 8"
    doc, notes = megatron((base + " " + flags).split(), nodes=1, gpus_per_node=8)
    p = doc["parallel"]
    assert (p["tp_comm_overlap"], p["overlap_param_gather"], p["tp_async_backward"]) == want
    assert not notes[1:]  # (the vocabulary's note only: nothing else unmapped)


def test_megatrons_pipeline_split_of_the_embedding_and_the_loss_is_imported():
    """--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split, and the virtual
    stages --num-layers-per-virtual-pipeline-stage makes with them (Megatron's arguments.py counts each as a
    layer): Llama 3 405B's 126 layers + 2 over 16 stages of 1 layer a chunk is 8 chunks a stage."""
    base = ("--pipeline-model-parallel-size 16 --num-layers 126 --hidden-size 256 --num-attention-heads 4 "
            "--seq-length 128 --micro-batch-size 1 --global-batch-size 32 --num-layers-per-virtual-pipeline-stage 1")
    doc, _ = megatron((base + " --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split").split(),
                      nodes=2, gpus_per_node=8)
    p = doc["parallel"]
    assert (p["embedding_in_split"], p["loss_in_split"], p["virtual_stages"], p["schedule"]) == (True, True, 8,
                                                                                                "interleaved")
    p = megatron(base.replace("126", "128").split(), nodes=2, gpus_per_node=8)[0]["parallel"]
    assert (p["embedding_in_split"], p["loss_in_split"], p["virtual_stages"]) == (False, False, 8)
    assert load(None, [f"parallel.{k}={str(v).lower()}" for k, v in doc["parallel"].items() if k.endswith("split")])


def test_megatrons_grouped_query_attention_takes_the_kv_heads_as_they_are():
    """Megatron-LM's --group-query-attention runs Transformer Engine's attention, which takes the key/value
    heads as they are (model.gqa = "native"); torchtitan's Llama repeats them before SDPA (repeat_kv)."""
    base = "--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --micro-batch-size 1 " \
           "--global-batch-size 8 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights"
    doc, _ = megatron((base + " --group-query-attention --num-query-groups 2").split(), nodes=1, gpus_per_node=8)
    assert (doc["model"]["kv_heads"], doc["model"]["gqa"]) == (2, "native")
    assert "gqa" not in megatron(base.split(), nodes=1, gpus_per_node=8)[0]["model"]
    job = __import__("tomllib").loads((DATA / "torchtitan_llama3_8b.toml").read_text())
    assert "gqa" not in torchtitan(job, nodes=1, gpus_per_node=8)[0]["model"]
    assert load(None, ["model.arch=llama", "model.kv_heads=1", "model.gqa=native"]).model.gqa == "native"


def test_torchtitans_async_tensor_parallelism_is_the_overlap():
    job = __import__("tomllib").loads((DATA / "torchtitan_llama3_8b.toml").read_text())
    assert torchtitan(job, nodes=2, gpus_per_node=8)[0]["parallel"]["tp_comm_overlap"] is False
    job["parallelism"] = {**job["parallelism"], "tensor_parallel_degree": 2, "enable_async_tensor_parallel": True}
    doc, notes = torchtitan(job, nodes=2, gpus_per_node=8)
    assert doc["parallel"]["tp_comm_overlap"] is True and doc["parallel"]["sp"] is True
    assert not doc["parallel"].get("tp_async_backward")  # (torch's pattern matcher: tensor_parallel.py)
    assert "enable_async_tensor_parallel" not in " ".join(notes)


def test_an_imported_megatron_run_runs(tmp_path, capsys):
    """The import command writes a scenario that `simcluster run` runs (a smaller layout of the same
    arguments' shape, so that the test is quick)."""
    args = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512", "--micro-batch-size", "1",
            "--global-batch-size", "16", "--bf16", "--sequence-parallel", "--use-distributed-optimizer",
            "--train-iters", "100"]
    out = tmp_path / "m.toml"
    assert main(["import", "--nodes", "1", "-o", str(out), "megatron", *args]) == 0
    assert "import: --train-iters" in capsys.readouterr().err
    sc = load(str(out))
    assert (sc.parallel.tp, sc.parallel.pp, sc.parallel.dp, sc.parallel.sp, sc.parallel.zero) == (2, 2, 2, True, 1)
    assert main(["run", str(out), "--summary"]) == 0
    assert "a steady step" in capsys.readouterr().out


def test_a_torchtitan_job_file_is_imported_and_runs(tmp_path, capsys):
    doc, notes = torchtitan(__import__("tomllib").loads((DATA / "torchtitan_llama3_8b.toml").read_text()),
                            nodes=2, gpus_per_node=8)
    m, p = doc["model"], doc["parallel"]
    assert (m["layers"], m["hidden"], m["ffn_hidden"], m["heads"], m["kv_heads"]) == LLAMA3["8B"]
    assert (m["seq"], m["global_batch"], m["arch"], p["dp"], p["zero"], p["recompute"]) == \
        (8192, 16, "llama", 16, 3, "op")
    assert p["grads_fp32"] is True  # (FSDP2's reduce_dtype: torchtitan's mixed_precision_reduce, float32 unless set)
    bf16_reduce = {**__import__("tomllib").loads((DATA / "torchtitan_llama3_8b.toml").read_text())}
    bf16_reduce["training"] = {**bf16_reduce["training"], "mixed_precision_reduce": "bfloat16"}
    assert torchtitan(bf16_reduce, nodes=2, gpus_per_node=8)[0]["parallel"]["grads_fp32"] is False
    named = " ".join(notes)
    assert all(f"[{t}]" in named for t in ("job", "profiling", "metrics", "lr_scheduler", "checkpoint"))
    assert "training.steps" in named and "optimizer.name" in named
    out = tmp_path / "t.toml"
    assert main(["import", "--nodes", "2", "-o", str(out), "torchtitan", str(DATA / "torchtitan_llama3_8b.toml")]) == 0
    assert main(["run", str(out), "--summary"]) == 0


@pytest.mark.parametrize("args,said", [
    (["megatron", "--num-layers"], "--num-layers needs a value"),
    (["megatron", "layers", "4"], "expected --name or --name value"),
    (["megatron", "--tensor-model-parallel-size", "3", "--num-layers", "4"], "does not divide the cluster's 8"),
    (["torchtitan", "/no/such.toml"], "No such file"),
])
def test_an_import_that_cannot_be_made_is_one_line(args, said, capsys):
    assert main(["import", *args]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


@pytest.mark.parametrize("name,key", [("tensor-model-parallel-size", "parallel.tp"), ("sequence_parallel", "parallel.sp"),
                                      ("tensor_parallel_degree", "parallel.tp"), ("seq_len", "model.seq"),
                                      ("model.name", "model.arch")])
def test_keys_finds_a_key_by_its_megatron_or_torchtitan_name(name, key, capsys):
    assert main(["keys", name]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"is {key} here" in out and f"{key} default" in out


def test_write_scenario_writes_the_scenario_as_run(tmp_path, capsys):
    """Every --set applied and every key resolved: loading the file gives the same scenario."""
    sets = ["--set", "parallel.zero=1", "--set", "model.layers=3", "--set", "run.steps=2", "--set",
            "faults.straggler_rank=1", "--set", 'description="a \\"quoted\\" \\\\ text"']
    out = tmp_path / "resolved.toml"
    assert main(["run", "--summary", "--write-scenario", str(out), *sets]) == 0
    again = load(str(out))
    assert again.as_dict() == load(None, [s for s in sets if s != "--set"]).as_dict()


@pytest.mark.parametrize("option, want", [("op", "op"), ("1", "full"), ("2", "full")])
def test_torchtitans_selective_checkpointing_is_mapped(option, want):
    """torchtitan's selective_ac_option: "op" is the per-op policy (parallel.recompute = "op"); a number N
    checkpoints every N-th block whole, which only N = 1 (every block) is here without a note."""
    job = {"model": {"name": "llama3", "flavor": "8B"}, "training": {"seq_len": 1024, "local_batch_size": 1},
           "activation_checkpoint": {"mode": "selective", "selective_ac_option": option}}
    doc, notes = torchtitan(job, nodes=1, gpus_per_node=8)
    assert doc["parallel"]["recompute"] == want
    assert any("every 2-th block" in n for n in notes) == (option == "2")

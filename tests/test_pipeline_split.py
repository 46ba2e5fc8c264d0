"""`parallel.embedding_in_split` and `parallel.loss_in_split`: the pipeline split counts the embedding, and the
head with its loss, as a layer each (Megatron-LM's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split; how Llama 3 405B balanced its 16 stages). Which blocks each chunk
holds, what is refused, the same bytes as one device, and the balance it buys."""

from __future__ import annotations

import pytest

from simcluster.config.scenario import load
from simcluster.config.schema import ScenarioError
from simcluster.parallel import pipeline
from simcluster.parallel.composed import chunk_units
from simcluster.run.job import job_of
from simcluster.run.runner import run_scenario


def test_llama_3s_pipeline_has_the_embedding_and_the_loss_alone_at_its_ends():
    """Llama 3 405B (Dubey et al. 2024, section 3.3.2): 126 blocks on 16 stages of 8 chunks; "the first model
    chunk on the first stage has only the embedding, and the last model chunk on the last stage has only
    output projection and loss calculation"; every other chunk one block, in order."""
    pieces = chunk_units(126, 128, True, True)
    assert pieces[0] == ("embed",) and pieces[-1] == ("head",)
    assert [u for piece in pieces[1:-1] for u in piece] == [f"block{i}" for i in range(126)]
    assert all(len(piece) == 1 for piece in pieces)


@pytest.mark.parametrize("embedding, loss, first, last", [
    (False, False, ("embed", "block0", "block1"), ("block4", "head")),
    (True, False, ("embed", "block0"), ("block4", "head")),
    (False, True, ("embed", "block0", "block1"), ("head",)),
    (True, True, ("embed", "block0"), ("head",))])
def test_each_end_takes_a_layers_place_in_its_chunk(embedding, loss, first, last):
    """5 blocks in 4 chunks: 2, 1, 1, 1 (the first chunks take one more); counting the embedding makes 6 slots
    (the embedding and one block first), counting the loss 6 too (the last chunk the head alone)."""
    pieces = chunk_units(5, 4, embedding, loss)
    assert pieces[0] == first and pieces[-1] == last
    assert [u for piece in pieces for u in piece if u.startswith("block")] == [f"block{i}" for i in range(5)]


LLAMA3 = ["run.numerics=meta", "model.arch=llama", "model.layers=126", "model.hidden=1024", "model.heads=8",
          "model.kv_heads=8", "model.ffn_hidden=1024", "model.seq=64", "model.vocab=256", "model.global_batch=16",
          "model.micro_batch=1", "cluster.gpus_per_node=16", "parallel.dp=1", "parallel.pp=16",
          "parallel.schedule=interleaved", "parallel.virtual_stages=8", "parallel.zero=1"]


def test_128_chunks_for_126_layers_need_both_ends_counted():
    with pytest.raises(ScenarioError, match="128 model chunks for 126 layers: every chunk needs a layer"):
        job_of(load(None, LLAMA3))
    with pytest.raises(ScenarioError, match="126 layers \\(and the embedding or the loss counted as layers\\)"):
        job_of(load(None, LLAMA3 + ["parallel.embedding_in_split=true"]))
    assert job_of(load(None, LLAMA3 + ["parallel.embedding_in_split=true", "parallel.loss_in_split=true"]))


SMALL = ["run.numerics=exact", "run.steps=2", "model.layers=2", "model.hidden=16", "model.heads=2",
         "model.ffn_hidden=32", "model.seq=8", "model.vocab=32", "model.global_batch=4", "model.micro_batch=1",
         "model.dropout=0.1",
         "cluster.gpus_per_node=4", "parallel.dp=2", "parallel.pp=2", "parallel.schedule=interleaved",
         "parallel.virtual_stages=2", "parallel.embedding_in_split=true", "parallel.loss_in_split=true"]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_chunks_of_the_embedding_alone_and_the_head_alone_are_bit_exact(arch):
    """2 blocks, 2 stages of 2 chunks: the embedding, block 0, block 1, the head; the GPT's head tied to its
    embedding across the stages (Megatron's embedding group)."""
    tied = "true" if arch == "gpt" else "false"
    report = run_scenario(load(None, SMALL + [f"model.arch={arch}", f"model.tied_head={tied}"]), trace=False).report
    assert report["verification"]["passed"], report["verification"]


def test_blocks_run_out_of_order_through_those_chunks_are_caught(monkeypatch):
    """The broken variant: blocks 0 and 1 (the chunks after the embedding's) swapped, each chunk still one
    block, so the pipeline runs and only the numbers can tell."""
    whole = pipeline._partition

    def broken(layers, chunks, embedding, loss):
        runs = whole(layers, chunks, embedding, loss)
        return (runs[0], runs[2], runs[1], *runs[3:])
    monkeypatch.setattr(pipeline, "_partition", broken)
    chunk_units.cache_clear()  # (the pieces are made once for a shape)
    try:
        assert chunk_units(2, 4, True, True) == (("embed",), ("block1",), ("block0",), ("head",))
        assert not run_scenario(load(None, SMALL), trace=False).report["verification"]["passed"]
    finally:
        chunk_units.cache_clear()


def test_counting_a_heavy_head_as_a_layer_shortens_the_step():
    """A Llama whose head outweighs a block (vocabulary 32,768 against hidden 1,024): 6 blocks on 4 stages put
    2 blocks on the last one beside the head, unless the head takes a layer's place; counted, the last stage
    holds 1 block and the step is shorter. (Meta mode: the simulated step, not this machine's time.)"""
    args = ["run.numerics=meta", "model.arch=llama", "model.layers=6", "model.hidden=1024", "model.heads=8",
            "model.kv_heads=8", "model.ffn_hidden=2048", "model.seq=1024", "model.vocab=32768",
            "model.global_batch=16", "model.micro_batch=1", "cluster.preset=dgx-h100", "cluster.gpus_per_node=4",
            "parallel.dp=1", "parallel.pp=4", "parallel.zero=1"]
    steps = {loss: run_scenario(load(None, args + [f"parallel.loss_in_split={loss}"]), trace=False).report[
        "steady_step_ns"] for loss in ("false", "true")}
    assert chunk_units(6, 4)[-1] == ("block5", "head") and chunk_units(6, 4, False, True)[-1] == ("head",)
    assert steps["true"] < steps["false"]

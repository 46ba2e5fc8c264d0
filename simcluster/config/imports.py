"""A door for Megatron-LM and torchtitan users: their configurations as simcluster scenarios.

    megatron(argv, ...)      Megatron-LM's command-line arguments (megatron/training/arguments.py's names)
    torchtitan(doc, ...)     a torchtitan job file ([model], [parallelism], [training], ...), parsed TOML

Each returns the scenario document and a line for every option it could not map (and why), so that
nothing is dropped silently. Neither says how many GPUs: the caller gives the cluster, and dp is what
the other degrees leave of it (as both tools compute it). The models run in meta mode at their real
size (shapes and costs; exact numbers at that size would be refused by the budget), two steps, so the
report has a steady step. `ALIASES` lets `simcluster keys` find a key by either tool's name.
"""

from __future__ import annotations

from typing import Any

from simcluster.config.scenario import flatten
from simcluster.config.schema import ScenarioError

# Megatron-LM's argument -> the scenario key it sets (values read as the key's type)
MEGATRON = {
    "num-layers": "model.layers", "hidden-size": "model.hidden", "num-attention-heads": "model.heads",
    "ffn-hidden-size": "model.ffn_hidden", "seq-length": "model.seq", "vocab-size": "model.vocab",
    "micro-batch-size": "model.micro_batch", "global-batch-size": "model.global_batch",
    "tensor-model-parallel-size": "parallel.tp", "pipeline-model-parallel-size": "parallel.pp",
    "context-parallel-size": "parallel.cp", "virtual-pipeline-model-parallel-size": "parallel.virtual_stages",
    "num-query-groups": "model.kv_heads", "hidden-dropout": "model.dropout", "lr": "run.lr",
    "weight-decay": "run.weight_decay", "clip-grad": "run.clip_grad", "seed": "run.seed",
    # flags and choices, read below
    "sequence-parallel": "parallel.sp", "recompute-granularity": "parallel.recompute",
    "recompute-activations": "parallel.recompute", "use-distributed-optimizer": "parallel.zero",
    "overlap-grad-reduce": "parallel.overlap_grad_reduce", "bf16": "model.dtype", "fp16": "model.dtype",
    "cp-comm-type": "parallel.attention", "num-layers-per-virtual-pipeline-stage": "parallel.virtual_stages",
    "swiglu": "model.arch", "normalization": "model.arch", "position-embedding-type": "model.arch",
    "untie-embeddings-and-output-weights": "model.arch", "group-query-attention": "model.kv_heads",
    "use-flash-attn": "model.attention_kernel", "accumulate-allreduce-grads-in-fp32": "parallel.grads_fp32",
    "grad-reduce-in-bf16": "parallel.grads_fp32", "tp-comm-overlap": "parallel.tp_comm_overlap",
    "overlap-param-gather": "parallel.overlap_param_gather",
    "no-async-tensor-model-parallel-allreduce": "parallel.tp_async_backward",
    "microbatch-group-size-per-vp-stage": "parallel.microbatch_group",
    "account-for-embedding-in-pipeline-split": "parallel.embedding_in_split",
    "account-for-loss-in-pipeline-split": "parallel.loss_in_split",
    "no-gradient-accumulation-fusion": "parallel.grad_accumulation_fusion",
    "cross-entropy-loss-fusion": "model.loss_kernel",
}
FLAGS = {"sequence-parallel", "recompute-activations", "use-distributed-optimizer", "overlap-grad-reduce", "bf16",
         "fp16", "swiglu", "untie-embeddings-and-output-weights", "group-query-attention", "use-flash-attn",
         "accumulate-allreduce-grads-in-fp32", "grad-reduce-in-bf16", "tp-comm-overlap", "overlap-param-gather",
         "no-async-tensor-model-parallel-allreduce", "account-for-embedding-in-pipeline-split",
         "account-for-loss-in-pipeline-split", "no-gradient-accumulation-fusion", "cross-entropy-loss-fusion"}
CHOICES = {"recompute-granularity", "cp-comm-type", "normalization", "position-embedding-type",
           "num-layers-per-virtual-pipeline-stage"}  # (read below, each its own way)
NUMBERS = {flag: key for flag, key in MEGATRON.items() if flag not in FLAGS | CHOICES}  # a number: the key's value
CP_COMM = {"p2p": "ring", "a2a": "ulysses", "allgather": "allgather"}  # Megatron's --cp-comm-type

# torchtitan's job-file key -> the scenario key it sets
TORCHTITAN = {
    "parallelism.tensor_parallel_degree": "parallel.tp", "parallelism.pipeline_parallel_degree": "parallel.pp",
    "parallelism.context_parallel_degree": "parallel.cp", "parallelism.data_parallel_shard_degree": "parallel.dp",
    "parallelism.data_parallel_replicate_degree": "parallel.dp",
    "parallelism.pipeline_parallel_schedule": "parallel.schedule",
    "parallelism.pipeline_parallel_microbatch_size": "model.micro_batch",
    "training.seq_len": "model.seq", "training.batch_size": "model.global_batch",
    "training.local_batch_size": "model.global_batch", "training.global_batch_size": "model.global_batch",
    "training.max_norm": "run.clip_grad", "training.mixed_precision_param": "model.dtype",
    "training.mixed_precision_reduce": "parallel.grads_fp32",
    "parallelism.enable_async_tensor_parallel": "parallel.tp_comm_overlap",
    "activation_checkpoint.mode": "parallel.recompute",
    "activation_checkpoint.selective_ac_option": "parallel.recompute", "optimizer.lr": "run.lr",
    "optimizer.weight_decay": "run.weight_decay", "model.flavor": "model.layers", "model.name": "model.arch",
}
SCHEDULES = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved", "InterleavedZeroBubble": "zb-h1",
             "ZBVZeroBubble": "zb-v", "DualPipeV": "dualpipe"}  # torchtitan's pipeline_parallel_schedule
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Llama 3's sizes (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3): layers, model dimension,
# FFN dimension, attention heads, key/value heads; vocabulary 128,256 tokens
LLAMA3 = {"8B": (32, 4096, 14336, 32, 8), "70B": (80, 8192, 28672, 64, 8), "405B": (126, 16384, 53248, 128, 8)}
LLAMA3_VOCAB = 128_256

ALIASES = {**{f"--{k}": v for k, v in MEGATRON.items()}, **TORCHTITAN}  # (what `keys` finds a key by)
WHY = {  # why an option that looks mappable is not
    "train-iters": "the emulator runs run.steps (2: a steady step after the first)",
    "training.steps": "the emulator runs run.steps (2: a steady step after the first)",
    "max-position-embeddings": "positions follow model.seq", "optimizer.name": "the optimizer is AdamW",
    "attention-dropout": "one dropout probability: model.dropout (--hidden-dropout)",
}
KEPT_TABLES = ("model", "parallelism", "training", "activation_checkpoint", "optimizer")  # torchtitan's read here


def alias(name: str) -> tuple[str, str] | None:
    """(the tool's spelling, the scenario key) for a Megatron-LM argument or torchtitan key, however
    written (--tensor-model-parallel-size, tensor_model_parallel_size, tensor_parallel_degree)."""
    plain = name.lstrip("-").replace("_", "-")
    if plain in MEGATRON:
        return f"Megatron-LM's --{plain}", MEGATRON[plain]
    for key, target in TORCHTITAN.items():
        if name in (key, key.split(".", 1)[1]):
            return f"torchtitan's {key}", target
    return None


def _number(text: str, where: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise ScenarioError(f"{where} {text!r}: a number is needed") from None


def parse_megatron(argv: list[str]) -> dict[str, str | bool]:
    """--name value and --flag pairs, by name (a word not after an option is a mistake)."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        if not word.startswith("--"):
            raise ScenarioError(f"Megatron-LM argument {word!r}: expected --name or --name value (the options of "
                                f"`simcluster import` itself, --nodes, --output, ..., go before 'megatron')")
        name, _, value = word[2:].partition("=")
        if value:
            out[name] = value
        elif name in FLAGS or i + 1 == len(argv) or argv[i + 1].startswith("--"):
            out[name] = True
        else:
            out[name] = argv[i + 1]
            i += 1
        i += 1
    return out


def _cluster(nodes: int, gpus_per_node: int, preset: str) -> dict[str, Any]:
    return {"preset": preset, "nodes": nodes, "gpus_per_node": gpus_per_node}


def _dp(world: int, tp: int, pp: int, cp: int, source: str) -> int:
    rest = tp * pp * cp
    if world % rest:
        raise ScenarioError(f"{source}: tp x pp x cp = {rest} does not divide the cluster's {world} GPUs "
                            f"(give --nodes and --gpus-per-node)")
    return world // rest


def megatron(argv: list[str], *, nodes: int = 1, gpus_per_node: int = 8, preset: str = "dgx-h100"
             ) -> tuple[dict[str, Any], list[str]]:
    """The scenario of a Megatron-LM command line, and what was not mapped."""
    args, notes = parse_megatron(argv), []
    doc: dict[str, dict[str, Any]] = {"model": {}, "parallel": {}, "run": {}}
    for name, value in args.items():
        if name not in MEGATRON:
            notes.append(f"--{name}: not mapped ({WHY.get(name, 'simcluster has no such setting')})")
        elif name in NUMBERS:
            if isinstance(value, bool):
                raise ScenarioError(f"--{name} needs a value")
            section, field = NUMBERS[name].split(".")
            doc[section][field] = _number(value, f"--{name}")
    m, p = doc["model"], doc["parallel"]
    m["dtype"] = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"  # (Megatron: fp32 by default)
    llama = bool(args.get("swiglu")) and args.get("normalization") == "RMSNorm" and \
        bool(args.get("untie-embeddings-and-output-weights")) and args.get("position-embedding-type", "rope") == "rope"
    m["arch"] = "llama" if llama else "gpt"
    if not llama and any(k in args for k in ("swiglu", "normalization")):
        notes.append("--swiglu / --normalization RMSNorm: simcluster's Llama has all of RMSNorm, SwiGLU, rotary "
                     "positions and an untied head; this model is run as the GPT")
    m["tied_head"] = not args.get("untie-embeddings-and-output-weights", False)  # (across stages too: Megatron's
    # embedding group, the first and last stages' copies' gradients all-reduced)
    if "ffn_hidden" not in m and "hidden" in m:  # (Megatron's default, as arguments.py computes it)
        m["ffn_hidden"] = int(4 * m["hidden"] * 2 / 3 / 64) * 64 if args.get("swiglu") else 4 * m["hidden"]
    if "vocab" not in m:
        m["vocab"] = 51_200
        notes.append("vocabulary from the tokenizer: taken as GPT-2's 50,257 padded to 51,200 (set model.vocab)")
    if not args.get("group-query-attention"):
        m.pop("kv_heads", None)
    else:  # (Transformer Engine's attention takes the key/value heads as they are)
        m["gqa"] = "native"
    if "dropout" not in m:
        m["dropout"] = 0.1  # (Megatron's --hidden-dropout default)
    m["loss_kernel"] = "fused" if args.get("cross-entropy-loss-fusion") else "unfused"
    p["sp"] = bool(args.get("sequence-parallel"))
    p["zero"] = 1 if args.get("use-distributed-optimizer") else 0  # (the distributed optimizer shards its states)
    p["overlap_grad_reduce"] = bool(args.get("overlap-grad-reduce"))
    p["overlap_param_gather"] = bool(args.get("overlap-param-gather"))
    p["grad_accumulation_fusion"] = not args.get("no-gradient-accumulation-fusion")  # (on unless turned off)
    p["tp_comm_overlap"] = bool(args.get("tp-comm-overlap"))  # (at tp = 1 Megatron turns sp off: it does nothing)
    # its column-parallel backward (layers.py), async unless --no-async-tensor-model-parallel-allreduce (2021-23);
    # under --tp-comm-overlap Transformer Engine's bulk overlaps run it so whatever that flag says
    p["tp_async_backward"] = p["tp_comm_overlap"] or not args.get("no-async-tensor-model-parallel-allreduce")
    # gradients in fp32: Megatron's arguments.py sets --accumulate-allreduce-grads-in-fp32 for bf16 (fp16: if given),
    # its --grad-reduce-in-bf16 reduces them in bf16 again
    p["grads_fp32"] = m["dtype"] != "fp32" and not args.get("grad-reduce-in-bf16") and \
        (m["dtype"] == "bf16" or bool(args.get("accumulate-allreduce-grads-in-fp32")))
    granularity = args.get("recompute-granularity") or ("selective" if args.get("recompute-activations") else "none")
    p["recompute"] = granularity
    tp, pp, cp = (int(p.get(a, 1)) for a in ("tp", "pp", "cp"))
    ends = {"embedding_in_split": bool(args.get("account-for-embedding-in-pipeline-split")),
            "loss_in_split": bool(args.get("account-for-loss-in-pipeline-split"))}  # (each a layer in the split)
    if "num-layers-per-virtual-pipeline-stage" in args and "layers" in m:
        per = int(_number(str(args["num-layers-per-virtual-pipeline-stage"]), "--num-layers-per-virtual-pipeline-stage"))
        p["virtual_stages"] = (m["layers"] + sum(ends.values())) // (pp * per)
    if pp > 1:
        p["schedule"] = "interleaved" if p.get("virtual_stages", 1) > 1 else "1f1b"
        p |= ends
    if cp > 1:
        p["attention"] = CP_COMM.get(str(args.get("cp-comm-type", "p2p")), "ring")
    p["dp"] = _dp(nodes * gpus_per_node, tp, pp, cp, "Megatron-LM's degrees")
    doc["run"] |= {"numerics": "meta", "verify": False, "steps": 2}
    return {"name": "megatron", "description": "imported from Megatron-LM's arguments",
            "cluster": _cluster(nodes, gpus_per_node, preset), **doc}, notes


def _checkpointing(given: dict[str, Any], notes: list[str]) -> str:
    """torchtitan's activation_checkpoint (its defaults in 2024-12: mode "selective", selective_ac_option "2")
    as parallel.recompute: "op" is the per-op policy; a number N checkpoints every N-th block whole."""
    mode = str(given.get("activation_checkpoint.mode", "selective"))
    if mode != "selective":
        return mode
    option = str(given.get("activation_checkpoint.selective_ac_option", "2"))
    if option == "op":
        return "op"
    if option != "1":
        notes.append(f"activation_checkpoint.selective_ac_option = {option!r} (every {option}-th block checkpointed "
                     f"whole): not modelled; every block is recomputed whole (parallel.recompute = full)")
    return "full"


def torchtitan(job: dict[str, Any], *, nodes: int = 1, gpus_per_node: int = 8, preset: str = "dgx-h100"
               ) -> tuple[dict[str, Any], list[str]]:
    """The scenario of a torchtitan job file (parsed TOML), and what was not mapped."""
    given, notes = dict(flatten(job)), []
    for table in job:
        if table not in KEPT_TABLES:
            notes.append(f"[{table}]: not mapped (simcluster has no such settings: logging, jobs, checkpoints, ...)")
    for key in given:
        if key not in TORCHTITAN and key.split(".", 1)[0] in KEPT_TABLES:
            notes.append(f"{key}: not mapped ({WHY.get(key, 'simcluster has no such setting')})")
    m: dict[str, Any] = {"arch": "llama", "tied_head": False, "vocab": LLAMA3_VOCAB}
    flavor = str(given.get("model.flavor", ""))
    if given.get("model.name", "llama3") != "llama3" or flavor not in LLAMA3:
        raise ScenarioError(f"torchtitan model {given.get('model.name')!r} flavor {flavor!r}: the sizes known are "
                            f"llama3's {', '.join(LLAMA3)} (the Llama 3 paper's); write the scenario's model.* by hand")
    m["layers"], m["hidden"], m["ffn_hidden"], m["heads"], m["kv_heads"] = LLAMA3[flavor]
    m["seq"] = int(given.get("training.seq_len", 2048))
    m["dtype"] = DTYPES.get(str(given.get("training.mixed_precision_param", "bfloat16")), "bf16")
    tp, pp, cp = (int(given.get(f"parallelism.{k}_parallel_degree", 1)) for k in ("tensor", "pipeline", "context"))
    replicate = int(given.get("parallelism.data_parallel_replicate_degree", 1))
    shard = int(given.get("parallelism.data_parallel_shard_degree", -1))
    dp = _dp(nodes * gpus_per_node, tp, pp, cp, "torchtitan's degrees")
    if shard != -1 and shard * replicate != dp:
        raise ScenarioError(f"torchtitan's data_parallel_shard_degree {shard} x replicate {replicate} is not the "
                            f"{dp} the cluster leaves (give --nodes and --gpus-per-node)")
    if replicate > 1:
        notes.append(f"data_parallel_replicate_degree = {replicate}: HSDP is run as FSDP over all {dp} "
                     f"data-parallel ranks (simcluster shards over the whole dp x cp group)")
    local = given.get("training.local_batch_size", given.get("training.batch_size"))
    m["global_batch"] = int(given.get("training.global_batch_size", int(local or 1) * dp))
    if "parallelism.pipeline_parallel_microbatch_size" in given:
        m["micro_batch"] = int(given["parallelism.pipeline_parallel_microbatch_size"])
    p: dict[str, Any] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "sp": tp > 1, "zero": 3, "grad_accumulation_fusion": False,
                         "recompute": _checkpointing(given, notes),
                         # FSDP2's reduce_dtype (its default, float32): the gradients reduced and kept in fp32
                         "grads_fp32": m["dtype"] != "fp32" and
                         str(given.get("training.mixed_precision_reduce", "float32")) == "float32",
                         # async TP (torch.compile's micro-pipelined all-gather-matmul and matmul-reduce-scatter)
                         "tp_comm_overlap": tp > 1 and bool(given.get("parallelism.enable_async_tensor_parallel"))}
    if pp > 1:
        schedule = str(given.get("parallelism.pipeline_parallel_schedule", "1F1B"))
        if schedule not in SCHEDULES:
            raise ScenarioError(f"torchtitan schedule {schedule!r}: valid here: {', '.join(SCHEDULES)}")
        p["schedule"] = SCHEDULES[schedule]
    if cp > 1:
        p["attention"] = "ring"  # (torchtitan's context parallelism: ring attention)
    r: dict[str, Any] = {"numerics": "meta", "verify": False, "steps": 2,
                         "clip_grad": float(given.get("training.max_norm", 1.0))}
    for key, field in (("optimizer.lr", "lr"), ("optimizer.weight_decay", "weight_decay")):
        if key in given:
            r[field] = float(given[key])
    return {"name": f"torchtitan_llama3_{flavor.lower()}", "description": "imported from a torchtitan job file",
            "cluster": _cluster(nodes, gpus_per_node, preset), "model": m, "parallel": p, "run": r}, notes


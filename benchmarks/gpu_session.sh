#!/usr/bin/env bash
# Issues 35 and 40: the GPU checks in one call of the device tool (not a test; about 7 minutes on one H100 or H200).
#
# The device machine has torch, numpy, rich, ml_dtypes, hypothesis and pytest, but not simpy or shtab:
# carry them as wheels. Once, here, in the repository's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl simpy==4.1.2 shtab==1.13.0
# then call the device tool with carry [".whl"] and the command `bash benchmarks/gpu_session.sh`.
# Everything it measures is written under $OUT (logs and the calibrated profile), which comes back.
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
(nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__)") 2>&1 | tee "$OUT/env.log"
# what this GPU keeps of its MAMF GEMM rate through a minute of load (the H100 preset's sustained_compute,
# 0.76, is fitted to a published run): the measured share, the clock and the power a second at a time; then
# the same of a causal flash attention kernel's rate (does attention, which draws less power, throttle less?)
timeout 100 python3 benchmarks/sustained_gemm.py --seconds 60 > "$OUT/sustained.log" 2>&1; tail -12 "$OUT/sustained.log"
timeout 100 python3 benchmarks/sustained_gemm.py --kernel attention --seconds 60 > "$OUT/sustained_attention.log" 2>&1
tail -6 "$OUT/sustained_attention.log"
# the fused attention kernels (FlashAttention-2, cuDNN, memory-efficient) causal and not, forward and backward,
# beside the preset's figures: does a causal kernel run its blocks at the non-causal rate, as the preset charges?
# And what does attention dropout (Megatron-LM's default 0.1, in Megatron-Core's table) cost inside each kernel,
# which the preset charges nothing for?
timeout 150 python3 benchmarks/attention_rates.py > "$OUT/attention.log" 2>&1; cat "$OUT/attention.log"
# exact and fast mode on NCCL against the emulator (one rank a GPU, at most 2)
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/test_gpu.py 2>&1 | tail -4 | tee "$OUT/tests.log"
# a DeepSeek-V3-like mixture of experts on one GPU in exact mode (routing read back, sigmoid scores, a shared
# expert under the all-to-all's place, node-limited groups, the selection bias): byte-identical?
timeout 90 python3 -m simcluster.cli run deepseek_v3 --backend torch --dist-backend nccl --json --set parallel.dp=1 \
    --set parallel.ep=1 --set parallel.pp=1 --set parallel.tp=1 --set parallel.sp=false --set parallel.schedule=1f1b \
    --set cluster.gpus_per_node=1 --set run.numerics=exact > "$OUT/moe.json" 2> "$OUT/moe.err"
python3 -c "import json; t = json.load(open('$OUT/moe.json'))['torch']; print('MoE exact on', t['device'], t['against_emulator'])" \
    2>&1 | tee "$OUT/moe.log"
# grouped-query attention with its kv heads as they are (model.gqa = "native": SDPA's enable_gqa, FlashAttention's
# own GQA kernel on a GPU) in fast mode: within the bound of the emulator?
timeout 60 python3 -m simcluster.cli run --backend torch --dist-backend nccl --json --set model.arch=llama \
    --set model.tied_head=false --set model.kv_heads=2 --set model.gqa=native --set model.dropout=0 \
    --set run.numerics=fast --set model.dtype=bf16 --set parallel.dp=1 --set cluster.gpus_per_node=1 \
    > "$OUT/gqa.json" 2> "$OUT/gqa.err"
python3 -c "import json; t = json.load(open('$OUT/gqa.json'))['torch']; print('native GQA on', t['device'], t['against_emulator'])" \
    2>&1 | tee "$OUT/gqa.log"
# a calibrated profile of this GPU (all-reduce over the GPUs where there are several)
timeout 150 python3 -m simcluster.cli calibrate -o "$OUT/profile.toml" --nproc "$GPUS" > "$OUT/calibrate.log" 2>&1
tail -3 "$OUT/calibrate.log"
# the ~1.2B GPT: plain PyTorch, the torch backend, and the emulator's predictions
timeout 200 python3 benchmarks/gpu_step.py --profile "$OUT/profile.toml" 2>&1 | tee "$OUT/step.log"
# what the step holds at its peak, by the line that made it, beside the predicted peak
timeout 100 python3 benchmarks/memory_at_peak.py > "$OUT/memory.log" 2>&1; head -14 "$OUT/memory.log"
# where the backend's step spends its time
timeout 100 python3 benchmarks/gpu_profile.py > "$OUT/profile.log" 2>&1; head -32 "$OUT/profile.log"
# the fidelity suite's H100 tables with this GPU's measured GEMM rates in place of the datasheet and MAMF
# figures (an H200 computes as an H100; its faster memory moves the memory-bound kernels), taken as measured
# (a profile drops the preset's sustained_compute, 0.76): does a short calibration's rate keep those tables
# as fast as MAMF's did? The strong table's fitted row says what share of the measured rates a run keeps.
timeout 240 python3 benchmarks/fidelity.py --table megatron-core-2024 --table megatron-core-2024-strong \
    --table torchtitan-2024 --table torchtitan-2025 --table llama3-2024 --set cluster.profile="$OUT/profile.toml" \
    > "$OUT/fidelity.log" 2>&1
tail -60 "$OUT/fidelity.log"

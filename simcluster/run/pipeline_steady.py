"""Meta mode at any micro-batch count: a pipeline's steady rounds are simulated twice, not m times.

A pipelined step of m micro-batches (1F1B, interleaved, zero-bubble, DualPipe) is a warm-up, rounds
of the same steady work, and a cool-down. One more micro-batch (for the interleaved schedule one more
group of p, for DualPipe two) puts one more round in the middle: every stage does one more block of
work, and everything after it happens one period P later. So a meta-mode run of m micro-batches a
step simulates m0 and m0 + u (`Micro.counts`). When (steady.py's `grown`), on every lane (rank and
stream), the second run is the first with, in each of its S steps, a block of events put in that
repeats the block before it P later, and every later event P later for each block put in before
it -- labels and message tags aside, which name the micro-batch -- (memory events likewise, each
block releasing what it holds),
the state that starts the next round is the state that started this one, shifted, and the simulation
is deterministic (as steady.py argues for steps): the run of m is the second with n = (m - m0 - u) / u
more such blocks a step. Its report follows: makespan E2 + nSP; every per-rank sum (busy time,
calls, bytes and time per collective, events, overlap) extended by n times its increment; memory
peaks the second run's. A run of more than 5 steps (steady.py) does this for its 2-step and 3-step
runs.
Byte for byte the report of simulating every micro-batch (tests/test_pipeline_steady.py): Megatron's
1T model (64 stages, 512 micro-batches) costs two runs of 67 and 68.
Where the rounds do not repeat yet (the pipeline's start still shows), the window moves up a round,
at most MOVES times and while the runs cost at most half of m; where they never do, all m are
simulated. ZeRO-2/3 is not tried: its per-micro-batch reduce-scatters fall further behind each round
(DeepSpeed refuses them with a pipeline; Megatron-LM pairs pipelines with ZeRO-1).
"""

from __future__ import annotations

from dataclasses import dataclass

from simcluster.config.schema import ModelSection, ParallelSection

# Where each schedule's rounds first repeat exactly, as measured on GPT layouts of 2 to 8 stages and on
# Megatron's 1T model (1F1B over 64 stages: from m = p + 3): m0 as (a multiple of p, rounds of u more).
# ZB-V settles later as its pipelines deepen: on llama3_4d's layouts from m = 3p, 3p + 1 and 3p + 2 at
# p = 4, 8 and 16 (and ZB-H1 from 2p + 1, 2p + 2, 2p + 4), so its window starts at 3p + 4 (from 2p + 3,
# its four moves never reached the repetition past p = 4, and every micro-batch was simulated after them)
START = {"1f1b": (1, 3), "interleaved": (1, 3), "zb-h1": (2, 4), "zb-v": (3, 4), "dualpipe": (2, 3)}
MOVES = 4  # how many times the window may move up a round before the m micro-batches are simulated


@dataclass(frozen=True)
class Micro:
    """The micro-batch counts a run of `m` simulates instead: `first`, then up in steps of `unit`."""

    first: int
    unit: int
    m: int

    @property
    def counts(self) -> tuple[int, int]:
        return self.first, self.first + self.unit

    def more(self, simulated: int) -> int:
        """Blocks a run of `m` has beyond the run of `simulated` micro-batches."""
        return (self.m - simulated) // self.unit

    def affordable(self, counts: list[int]) -> bool:
        """Whether runs of these counts together cost at most half of the whole run."""
        return 2 * sum(counts) <= self.m


def micro_counts(model: ModelSection, parallel: ParallelSection) -> Micro | None:
    """The counts for a GPT step of this model and layout, or None where simulating all m micro-batches
    costs no more (or the schedule does not settle into rounds: GPipe holds every micro-batch)."""
    p, schedule = parallel.pp, parallel.schedule
    if p < 2 or schedule not in START or not model.micro_batch or parallel.zero >= 2:
        return None  # (ZeRO-2/3 reduce-scatter every micro-batch: behind a pipeline their backlog grows)
    m = model.global_batch // parallel.dp // model.micro_batch
    unit = p if schedule == "interleaved" else 2 if schedule == "dualpipe" else 1
    stages, rounds = START[schedule]
    micro = Micro(stages * p + rounds * unit, unit, m)
    if not micro.affordable(list(micro.counts)) or (m - micro.first) % unit:
        return None
    return micro

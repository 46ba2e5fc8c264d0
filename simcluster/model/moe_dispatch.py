"""How a mixture of experts' tokens reach their experts and come back: the layer's dispatcher.

model/moe.py routes; a dispatcher does the rest, in four generators (they communicate under expert
parallelism):

  dispatch          the rows of the tokens routed to this rank's experts, expert by expert;
  combine           the experts' output rows back into tokens, y_t = sum_j g_tj out_tj (exact over j);
  combine_backward  dy into each expert's output rows, and the gates' gradients (T, k);
  dispatch_backward the experts' input-gradient rows back into tokens, summed (exactly) over their slots.

Two kinds, as Megatron-Core has them:

- by rows (`Rows`): each token's routed rows, in expert, token, choice order, go to whoever holds the
  experts and the outputs come back to be weighted and summed where the token lives. `Local` keeps
  them on this rank; expert parallelism's all-to-all (parallel/expert_parallel.py) sends them.
- by gathering (parallel/expert_parallel.py's AllGather): every token of the ep group comes to every
  rank, which weights its experts' outputs and reduce-scatters them back (Megatron-Core's "allgather").

Every dispatcher gives an expert the same rows in the same order (its own rank's in rank order), and
a token the exact sum of its weighted slots: which one ran changes no bit.
"""

from __future__ import annotations

from typing import Any, Generator


class Rows:
    """Dispatch by rows: a subclass says how the rows go (`plan`, `there`) and come back (`back`)."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    def dispatch(self, x: Any, r: Any, gates: Any, meanwhile: Any = None) -> Generator[Any, Any, tuple[list, Any, dict]]:
        """Tokens x (T, h) routed as `r` says: my experts' input rows, what `meanwhile()` computed while
        they travelled, and what the other three need."""
        rows = self.layer.ops.embedding(r.token_of_row, x)  # (R, h)
        plan = yield from self.plan(r.bounds)
        inputs, early = yield from self.there(rows, plan, meanwhile)
        return inputs, early, {"plan": plan}

    def combine(self, outs: list[Any], r: Any, gates: Any, state: dict) -> Generator[Any, Any, Any]:
        ops = self.layer.ops
        state["slots"] = ops.embedding(r.pos, (yield from self.back(outs, state["plan"])))  # (T, k, h): 0 if dropped
        return ops.finalize(ops.sum(ops.mul(state["slots"], ops.expand_last(gates)), 1, partial=True))

    def combine_backward(self, dy: Any, r: Any, gates: Any, state: dict,
                         meanwhile: Any = None) -> Generator[Any, Any, tuple[list, Any, Any]]:
        """dy (T, h): my experts' output-gradient rows, the gates' gradient (T, k), and `meanwhile()`'s value."""
        ops, layer = self.layer.ops, self.layer
        (t, h), k = dy.shape, gates.shape[1]
        dyf = layer._middle(dy)  # (T, 1, h)
        d_slots = ops.mul(dyf, ops.expand_last(gates))  # (T, k, h)
        d_gates = ops.finalize(ops.sum(ops.mul(dyf, state["slots"]), -1, partial=True))  # (T, k)
        d_out = ops.embedding(r.slot_of_row, layer._view(d_slots, (t * k, h)))  # (R, h)
        d_in, early = yield from self.there(d_out, state["plan"], meanwhile)
        return d_in, d_gates, early

    def dispatch_backward(self, dx_rows: list[Any], r: Any, state: dict) -> Generator[Any, Any, Any]:
        ops = self.layer.ops
        back = yield from self.back(dx_rows, state["plan"])
        return ops.finalize(ops.sum(ops.embedding(r.pos, back), 1, partial=True))

    def plan(self, bounds: tuple[int, ...]) -> Generator[Any, Any, Any]:
        raise NotImplementedError

    def there(self, rows: Any, plan: Any, meanwhile: Any = None) -> Generator[Any, Any, tuple[list[Any], Any]]:
        raise NotImplementedError

    def back(self, outs: list[Any], plan: Any) -> Generator[Any, Any, Any]:
        raise NotImplementedError


class Local(Rows):
    """Every expert on this rank: rows grouped by expert are sliced for each, and joined back."""

    def plan(self, bounds: tuple[int, ...]) -> Generator[Any, Any, tuple[int, ...]]:
        return bounds
        yield  # (a generator: expert parallelism's plan communicates)

    def there(self, rows: Any, bounds: tuple[int, ...], meanwhile: Any = None) -> Generator[Any, Any, tuple[list[Any], Any]]:
        return ([self.layer.slice_rows(rows, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1)],
                meanwhile() if meanwhile is not None else None)
        yield

    def back(self, outs: list[Any], bounds: tuple[int, ...]) -> Generator[Any, Any, Any]:
        return self.layer.ops.concat(outs, 0)
        yield

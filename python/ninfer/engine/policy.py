"""Batch policies: what one engine step runs. A policy sees each slot's state and names the prompt chunks to
evaluate and the slots that decode one token; the loop runs that plan and knows nothing else about the choice.

- `PromptsAlone` (deterministic): a prompt chunk is a forward call of its own, so a greedy answer is the one
  `LLM.generate` gives whatever else the engine is doing. `LLM` uses it; `ninfer serve --batch-policy
  deterministic`.
- `MixedChunks` (throughput, `ninfer serve`'s default): new prompts, split into chunks under a token budget per
  step, run in the same forward pass as the other slots' decode rows (chunked prefill, as vLLM and llama-server
  do), so a new request neither stalls the running streams for a whole prompt nor costs a forward call of its own.
  Rows computed in one batch are summed in a batch's order, so a greedy answer may differ from `LLM.generate`'s
  by rounding (a request alone, with a prompt within the budget, gets exactly its answer)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SlotView:
    index: int
    busy: bool  # a request holds the slot
    pending: int  # prompt tokens it has still to evaluate (0: it is generating)
    order: int = 0  # when its request was admitted (smaller: earlier), for first-come first-served chunks


@dataclass(frozen=True)
class StepPlan:
    prefill: list[int]  # slots whose next prompt chunk runs, each in its own forward call, in this order
    decode: list[int]  # slots that decode one token, together as one batch
    # (slot, prompt tokens) evaluated in the decode batch's forward pass; a slot whose prompt ends here samples
    # its first token from that pass and decodes from the next step on
    mixed: list[tuple[int, int]] = field(default_factory=list)


class PromptsAlone:
    """Latency-fair and reproducible: at most one prompt chunk a step, evaluated alone (its own forward call, the
    chunks `LLM.generate` would make), so a prompt never stalls the others for more than one chunk, and a greedy
    answer is the same whatever else the engine is doing; then every generating slot decodes, as one batch."""

    name = "deterministic"

    def plan(self, slots: list[SlotView]) -> StepPlan:
        first = min((s for s in slots if s.busy and s.pending), key=lambda s: s.order, default=None)
        return StepPlan(
            prefill=[] if first is None else [first.index],
            # (the slot whose prompt finishes in this step decodes from the next step on)
            decode=[s.index for s in slots if s.busy and not s.pending],
        )


class MixedChunks:
    """Every generating slot decodes, and the waiting prompts fill what is left of `token_budget` rows in the same
    forward pass, the earliest admitted first (at least one prompt token a step, so prompts always advance).
    A prompt's rows cost about what decode rows cost on a CPU, so the budget bounds how long a new prompt holds up
    the others' next token. When no slot is generating nobody waits on the step: prompts then go in chunks of
    `n_batch`, as `LLM.generate` evaluates them (so a request alone gets exactly its answer)."""

    name = "throughput"

    def __init__(self, token_budget: int, n_batch: int):
        for name, v in (("token budget per step", token_budget), ("n_batch", n_batch)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"the {name} must be a positive integer, got {v!r}")
        self.token_budget = token_budget
        self.n_batch = n_batch

    def plan(self, slots: list[SlotView]) -> StepPlan:
        decode = [s.index for s in slots if s.busy and not s.pending]
        room = max(1, self.token_budget - len(decode)) if decode else self.n_batch
        mixed = []
        for s in sorted((s for s in slots if s.busy and s.pending), key=lambda s: s.order):
            if room <= 0:
                break
            n = min(s.pending, room)
            mixed.append((s.index, n))
            room -= n
        return StepPlan(prefill=[], decode=decode, mixed=mixed)


POLICIES = ("throughput", "deterministic")


def make_policy(name: str, token_budget: int, n_batch: int) -> PromptsAlone | MixedChunks:
    """The policy `ninfer serve --batch-policy NAME` runs (the budget is MixedChunks' rows per step)."""
    if name == "throughput":
        return MixedChunks(token_budget, n_batch)
    if name == "deterministic":
        return PromptsAlone()
    raise ValueError(f"unknown batch policy {name!r}: {' or '.join(POLICIES)}")

"""Batch policies: what one engine step runs. A policy sees each slot's state and names the slots whose next
prompt chunk is evaluated and the slots that decode one token; the loop runs that plan and knows nothing else
about the choice, so another policy (e.g. prompt chunks mixed into the decode batch, for throughput) can be added
beside this one without touching the loop."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotView:
    index: int
    busy: bool  # a request holds the slot
    pending: int  # prompt tokens it has still to evaluate (0: it is generating)


@dataclass(frozen=True)
class StepPlan:
    prefill: list[int]  # slots whose next prompt chunk runs, each in its own forward call, in this order
    decode: list[int]  # slots that decode one token, together as one batch


class PromptsAlone:
    """Latency-fair and reproducible: at most one prompt chunk a step, evaluated alone (its own forward call, the
    chunks `LLM.generate` would make), so a prompt never stalls the others for more than one chunk, and a greedy
    answer is the same whatever else the engine is doing; then every generating slot decodes, as one batch."""

    name = "prompts-alone"

    def plan(self, slots: list[SlotView]) -> StepPlan:
        first = next((s.index for s in slots if s.busy and s.pending), None)
        return StepPlan(
            prefill=[] if first is None else [first],
            # (the slot whose prompt finishes in this step decodes from the next step on)
            decode=[s.index for s in slots if s.busy and not s.pending],
        )

"""GET /slots, as llama-server answers it: one object per slot with what it holds and does. Read from the engine
loop's slots while it runs (attribute reads of plain Python objects: a snapshot that may be a step old, never a
torn value)."""

from __future__ import annotations

from typing import Any

from ninfer.engine import EngineThread


def slots_view(sched: EngineThread, n_ctx: int) -> list[dict[str, Any]]:
    out = []
    for s in sched.core.slots:
        req, output = s.req, s.output
        busy = req is not None
        item: dict[str, Any] = {
            "id": s.index,
            "id_task": req.id if busy else -1,
            "n_ctx": n_ctx,
            "speculative": sched.core.speculator is not None,
            "is_processing": busy,
            "n_cached": len(s.kv_tokens),  # tokens the slot's KV cache holds (a finished prompt kept for reuse too)
            "n_prompt_tokens": len(req.prompt) if busy else 0,
            "n_prompt_tokens_pending": len(s.pending) if busy else 0,
            "n_decoded": len(output.tokens) if busy and output is not None else 0,
        }
        if busy:
            p = req.params
            item["params"] = {
                "n_predict": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                "min_p": p.min_p, "seed": p.seed if p.seed is not None else -1, "stop": list(p.stop),
                "n_probs": p.n_probs, "constrained": p.grammar is not None,
            }
        out.append(item)
    return out

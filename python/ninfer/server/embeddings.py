"""The embedding endpoints: OpenAI's /v1/embeddings and llama-server's /embedding. Each input is tokenized, then
embedded on the engine loop's thread (`Job`, between the other requests' steps) by ninfer.embeddings."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ninfer.embeddings import embed_job
from ninfer.engine import EngineThread
from ninfer.llm import LLM
from ninfer.server.errors import APIError
from ninfer.server.jobs import run_job

MAX_INPUTS = 256  # texts one request may embed


def _inputs(raw: Any) -> list[str | list[int]]:
    """One text or token list, or a list of them, as a list."""
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise APIError(400, "input is empty: give a text, a list of texts or of token lists", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"{len(items)} inputs is more than the {MAX_INPUTS} a request may embed", param="input")
    return items


async def run(llm: LLM, sched: EngineThread, raw: Any, pooling: str,
              prompt_ids: Callable[[LLM, Any], Awaitable[list[int]]]) -> list[tuple[np.ndarray, int]]:
    """[(embedding, tokens)] of each input, in order."""
    out = []
    for item in _inputs(raw):
        ids = await prompt_ids(llm, item)
        out.append((await run_job(sched, embed_job(ids, llm.config.n_batch, pooling, normalize=True)), len(ids)))
    return out


def openai_answer(results: list[tuple[np.ndarray, int]], model: str, encoding: str) -> dict[str, Any]:
    def vector(v: np.ndarray) -> Any:
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if encoding == "base64" else v.tolist()

    n = sum(k for _, k in results)
    return {"object": "list", "model": model, "usage": {"prompt_tokens": n, "total_tokens": n},
            "data": [{"object": "embedding", "index": i, "embedding": vector(v)} for i, (v, _) in enumerate(results)]}


def llama_answer(results: list[tuple[np.ndarray, int]]) -> list[dict[str, Any]]:
    """llama-server's shape: per input, its pooled embedding as a one-row list."""
    return [{"index": i, "embedding": [v.tolist()]} for i, (v, _) in enumerate(results)]

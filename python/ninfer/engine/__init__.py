"""The one engine loop over every backend: requests (request.py), the step (core.py), its batch policy
(policy.py), text out of tokens (output.py), the backend interface (backend.py), and the loop on a thread of its
own for the server and AsyncLLM (thread.py)."""

from ninfer.engine.backend import Backend
from ninfer.engine.core import EngineCore, Limits
from ninfer.engine.output import Finish, OutputText, stop_holdback
from ninfer.engine.policy import POLICIES, MixedChunks, PromptsAlone, make_policy
from ninfer.engine.request import (AsyncRequest, DeadlineError, GenParams, Job, Probs, QueueFullError, Request,
                                   Result)
from ninfer.engine.thread import EngineThread, check_serving_args

__all__ = [
    "POLICIES", "AsyncRequest", "Backend", "DeadlineError", "EngineCore", "EngineThread", "Finish", "GenParams", "Job",
    "Limits", "MixedChunks", "OutputText", "Probs", "PromptsAlone", "QueueFullError", "Request", "Result",
    "check_serving_args", "make_policy", "stop_holdback",
]

"""ninfer's HTTP server: llama.cpp- and OpenAI-compatible, continuous batching over `--parallel` slots.

    from ninfer.server import create_app, ServerSettings
    app = create_app(ninfer.LLM("model.gguf", n_seq_max=4), settings=ServerSettings(n_parallel=4))

`ninfer serve` (also `ninfer-cli`) runs it on uvicorn; see ninfer/server/cli.py for the flags.
"""

from typing import Any

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `import ninfer.server` does not need the web stack until the app is asked for.
    if name in __all__:
        from ninfer.server import app

        return getattr(app, name)
    raise AttributeError(name)

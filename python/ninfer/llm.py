"""The public Python API: `LLM` loads a GGUF model and generates text.

    llm = ninfer.LLM("model.gguf", n_ctx=4096, threads=4)
    out = llm.generate("The capital of France is", max_tokens=32, temperature=0)
    for piece in llm.stream("Once upon a time", max_tokens=64): print(piece, end="")
    llm.chat([{"role": "user", "content": "Hi"}])

Generation runs on the engine loop (ninfer.engine), stepped here on the caller's thread: per generated token one
call into the backend (the layer loop, then sampling); prompts are evaluated in chunks of `n_batch` tokens.
"""

from __future__ import annotations

import numbers
import os
import queue
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ninfer import _core
from ninfer.backends import resolve_device
from ninfer.chat import ChatTemplate
from ninfer.config import CACHE_TYPES, EngineConfig, RopeConfig, SamplingParams, stop_strings
from ninfer.embeddings import embed_job
from ninfer.engine import Backend, EngineCore, GenParams, Job, Limits, Request, Result
from ninfer.engine.speculative import DraftProposer, NgramProposer, SpecConfig, Speculator, check_vocab
from ninfer.errors import ContextOverflowError, InvalidArgumentError
from ninfer.model_file import ModelFile
from ninfer.structured import Grammar
from ninfer.tokenizer import Tokenizer

# The sequence eval_logits uses (the engine loop's first slot, idle while it runs).
_SEQ = 0


@dataclass(frozen=True)
class Timings:
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0  # speculative decoding: tokens drafted, and of them accepted (llama-server's fields)
    draft_n_accepted: int = 0

    @property
    def prompt_per_second(self) -> float:
        return 1000.0 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return 1000.0 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length"
    timings: Timings
    stopping_word: str = ""


@dataclass
class Stream:
    """Iterate for text pieces as they are generated; `result` holds the Completion once iteration ends."""

    _pieces: Iterator[str]
    result: Completion | None = field(default=None, init=False)

    def __iter__(self) -> Iterator[str]:
        return self._pieces


class LLM:
    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        n_ctx: int = 4096,
        threads: int = 0,
        n_batch: int = 512,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        device: str = "cpu",
        n_gpu_layers: int = -1,
        gpu_mem_budget: int | str | None = None,
        log: Any = None,
        n_seq_max: int = 1,
        chat_template: str | None = None,
        draft_model: str | os.PathLike[str] | None = None,
        speculative: SpecConfig | dict[str, Any] | bool | None = None,
        kv_l1: int = 0,
        kv_l2: int = 0,
        kv_select: int = 0,
        kv_l3_file: str | os.PathLike[str] | None = None,
        no_l3_cache: bool = False,
        kv_scorer: str | None = None,
        kv_rescan: int | None = None,
        host_mem_budget: int | str | None = None,
        rope_scaling: str | None = None,
        rope_scale: float | None = None,
        rope_freq_base: float | None = None,
        rope_freq_scale: float | None = None,
        yarn_orig_ctx: int | None = None,
        yarn_ext_factor: float | None = None,
        yarn_attn_factor: float | None = None,
        yarn_beta_fast: float | None = None,
        yarn_beta_slow: float | None = None,
    ):
        """device: "cpu", "cuda" or "auto" (cuda when CuPy sees a GPU). On cuda, n_gpu_layers puts the first N
        layers on the GPU and the rest on the CPU (-1: all, or as many as gpu_mem_budget allows, e.g. "12GiB");
        `log` receives the memory plan printed at load. n_seq_max: sequences the KV cache holds at once, each up
        to n_ctx tokens (the server's slots; the LLM methods use one). chat_template: a Jinja chat template used
        instead of the model's (for a GGUF without one, or to change it), compiled here.

        Speculative decoding (engine/speculative.py): draft_model, a GGUF with this model's
        vocabulary that drafts tokens for it; or speculative=True for n-gram lookup (no second model). speculative
        may also be a SpecConfig or a dict of its fields (n_max, n_min, p_min, ngram_min, ngram_max).

        Tiered KV cache: kv_l1 > 0 keeps the newest kv_l1 tokens (and the first block, the attention sinks)
        in f16, the next kv_l2 in q8_0 and older ones in q4_0 in an L3 ring (anonymous memory, or the file
        kv_l3_file); kv_select > 0 makes each decode step read only that many tokens of the older tiers, the
        blocks kv_scorer ranks highest (0: all of them). On cuda, L1 and L2 are in GPU memory and L3
        in pinned host memory (at most host_mem_budget, e.g. "16GiB"); with a gpu_mem_budget and kv_l2 0, L2
        takes what the budget leaves after the weights (the plan goes to `log`). kv_l3_file is CPU only.
        no_l3_cache=True keeps every older block in L2 (on the device, on cuda): no L3 and no host reads.
        kv_scorer: how selection ranks older blocks, "keys" (the largest q·k over each block's stored keys; the
        default; on cuda it keeps L3's keys in GPU memory, its values in host memory) or "bound" (Quest's bound from
        each block's key minimum and maximum: cheaper, less accurate in real text). kv_rescan: decode steps one
        ranking of every older block serves (default 8; 1: rank them all every step); the steps between rank its
        shortlist, the best 4x kv_select tokens' blocks, and the blocks that became older since (on cuda with the
        keys scorer; the bound ranks every step there).

        RoPE (llama.cpp's --rope-* and --yarn-* flags, the same meanings; None: the model file's setting):
        rope_scaling "none", "linear" or "yarn"; rope_scale N stretches the trained context N times (or
        rope_freq_scale 1/N); rope_freq_base; yarn_orig_ctx, the context the model was trained at; yarn_ext_factor,
        yarn_attn_factor, yarn_beta_fast, yarn_beta_slow (ninfer.config.RopeConfig). E.g. Qwen2.5 past its 32K:
        rope_scaling="yarn", rope_scale=4, yarn_orig_ctx=32768."""
        if not isinstance(n_seq_max, int) or n_seq_max < 1:
            raise InvalidArgumentError(f"n_seq_max must be a positive integer, got {n_seq_max!r}")
        if model is None:
            from ninfer.default_model import default_model_path

            model = default_model_path()
        self.config = EngineConfig(
            n_ctx=n_ctx, threads=threads, n_batch=n_batch, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
            kv_l1=kv_l1, kv_l2=kv_l2, kv_select=kv_select, kv_l3_file=None if kv_l3_file is None else str(kv_l3_file),
            no_l3_cache=no_l3_cache, kv_scorer=kv_scorer, kv_rescan=kv_rescan,
        )
        self.rope = RopeConfig(
            rope_scaling=rope_scaling, rope_scale=rope_scale, rope_freq_base=rope_freq_base,
            rope_freq_scale=rope_freq_scale, yarn_orig_ctx=yarn_orig_ctx, yarn_ext_factor=yarn_ext_factor,
            yarn_attn_factor=yarn_attn_factor, yarn_beta_fast=yarn_beta_fast, yarn_beta_slow=yarn_beta_slow,
        )
        self.model_file = ModelFile(model, rope=self.rope)
        spec = self.model_file.spec
        self.tokenizer = Tokenizer.from_metadata(self.model_file.metadata)
        from ninfer.backends.budget import parse_size

        # (read whatever the device: a malformed size is the caller's mistake even where no GPU is used)
        def size_of(name: str, value: int | str | None, example: str) -> int | None:
            size = parse_size(value) if isinstance(value, str) else value
            if size is not None and (not isinstance(size, int) or size < 0):
                raise InvalidArgumentError(f"{name} must be a size such as '{example}' or bytes >= 0, got {size!r}")
            return size

        budget = size_of("gpu_mem_budget", gpu_mem_budget, "12GiB")
        host_budget = size_of("host_mem_budget", host_mem_budget, "16GiB")
        self.device = resolve_device(device)
        if self.device == "cuda":
            from ninfer.backends.cuda_engine import CudaEngine

            if self.config.kv_l3_file is not None:
                raise InvalidArgumentError("kv_l3_file is the CPU backend's L3 ring; on cuda L3 is pinned host memory")
            tiers = ({"kv_l1": self.config.kv_l1, "kv_l2": self.config.l2_tokens, "kv_select": self.config.kv_select,
                      "kv_scorer": self.config.resolved_kv_scorer, "kv_rescan": self.config.resolved_kv_rescan}
                     if self.config.tiered else None)
            self.backend: Backend = CudaEngine(
                self.model_file, n_ctx=self.config.n_ctx, threads=self.config.resolved_threads,
                n_batch=self.config.n_batch, n_gpu_layers=n_gpu_layers, gpu_mem_budget=budget, log=log,
                n_seq_max=n_seq_max, cache_type_k=cache_type_k, cache_type_v=cache_type_v, kv_tiers=tiers,
                host_mem_budget=host_budget, page_size=self.config.block_size,
            )
        else:
            self.backend = _core.Engine(
                self.model_file.gguf,
                spec,
                threads=self.config.resolved_threads,
                n_ctx=self.config.n_ctx,
                block_size=self.config.block_size,
                k_type=CACHE_TYPES[self.config.cache_type_k][0],
                v_type=CACHE_TYPES[self.config.cache_type_v][0],
                kv_l1=self.config.kv_l1,
                kv_l2=self.config.l2_tokens,
                kv_select=self.config.kv_select,
                kv_l3_file=self.config.kv_l3_file,
                kv_scorer=self.config.resolved_kv_scorer,
                kv_rescan=self.config.resolved_kv_rescan,
                n_seq_max=n_seq_max,
            )
        self.n_seq_max = n_seq_max
        self._n_vocab = int(self.backend.n_vocab)  # read once: the server reads it while its thread runs a step
        self._engine: EngineCore | None = None
        self.draft: LLM | None = None  # the draft model's LLM, when speculative decoding has one
        self._speculator = self._make_speculator(draft_model, speculative)
        self._chat_template: ChatTemplate | None = None
        if chat_template is not None:  # (compiled now: a syntax error is named at load, not at the first chat)
            self._chat_template = ChatTemplate.from_metadata(self.model_file.metadata, template=chat_template)

    # ---- introspection -------------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.config.n_ctx

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def architecture(self) -> str:
        return self.model_file.architecture

    def kv_memory(self) -> dict[str, Any]:
        """What the CPU KV cache's blocks in use hold, by tier: {"l1": (blocks, bytes), "l2": ..., "l3": ...,
        "meta_bytes": ...} (a plain cache's blocks all count as l1)."""
        if self.device != "cpu":
            if not self.config.tiered:
                raise InvalidArgumentError("kv_memory reports the CPU backend's KV cache, or a tiered one on cuda")
            return self.backend.tier_memory()
        return dict(self.backend.kv_memory())

    def set_kv_select(self, kv_select: int) -> None:
        """Read `kv_select` tokens of the older tiers in each decode step from now on (0: all of them), the cache's
        contents as they are: selection applies to decode steps only, so one prompt's prefill serves several budgets
        (a tiered cache made with kv_select > 0, on the CPU backend)."""
        if kv_select < 0:
            raise InvalidArgumentError(f"kv_select must be >= 0, got {kv_select}")
        self.backend.set_kv_select(kv_select)
        self.config = replace(self.config, kv_select=kv_select)

    def kv_prefetch_stats(self) -> dict[str, int] | None:
        """The tiered KV cache's prefetch counts: on the CPU its prefetch thread's L3 block-layers a step found staged
        ("hits"), waited for ("stalls"), dequantized itself ("misses"), and staged in all ("staged"); on the GPU its
        device hot cache's L3 page-head-layers found in a slot ("hits"), read from host memory ("misses") and
        copied into a slot ("staged"). None without one (kv_select 0)."""
        stats = self.backend.kv_prefetch_stats()
        return None if stats is None else dict(stats)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    # ---- the engine loop -------------------------------------------------------------------------------------
    @property
    def engine(self) -> EngineCore:
        """The engine loop over this model's backend, one slot per sequence the KV cache holds (n_seq_max). The
        LLM methods step it on the caller's thread; the server and AsyncLLM run it on an EngineThread."""
        if self._engine is None:
            c = self.config
            max_blocks = -(-c.n_ctx // c.block_size) * self.n_seq_max
            self._engine = EngineCore(self.backend, self.tokenizer, Limits(c.n_ctx, c.n_batch, max_blocks),
                                      n_slots=self.n_seq_max, speculator=self._speculator)
        return self._engine

    def _make_speculator(self, draft_model: Any, speculative: Any) -> Speculator | None:
        if draft_model is None and speculative in (None, False):
            return None
        if isinstance(speculative, SpecConfig):
            config = speculative
        elif isinstance(speculative, dict):
            config = SpecConfig(**speculative)
        elif speculative in (None, True, False):
            if speculative is False:
                raise InvalidArgumentError("speculative=False with a draft_model: leave out one of them")
            config = SpecConfig()
        else:
            raise InvalidArgumentError(f"speculative must be True, a SpecConfig or a dict, got {speculative!r}")
        if self.device != "cpu":
            raise InvalidArgumentError("speculative decoding runs on the CPU backend so far (its verify pass needs "
                                       "rows computed as single steps, which the CUDA backend does not offer yet)")
        if draft_model is None:
            return Speculator(NgramProposer(config), config)
        c = self.config
        self.draft = LLM(draft_model, n_ctx=c.n_ctx, threads=c.threads, n_batch=c.n_batch,
                         n_seq_max=self.n_seq_max)
        check_vocab(self, self.draft)
        return Speculator(DraftProposer(self.draft.backend, config, n_batch=c.n_batch), config)

    def clear_cache(self) -> None:
        """Forget every idle sequence's KV cache (prompts kept for reuse by cache_prompt)."""
        self._check_not_served()
        for i in range(len(self.engine.slots)):
            if not self.engine.slots[i].busy:
                self.engine.release(i)

    # ---- evaluation ----------------------------------------------------------------------------------------
    def eval_logits(self, tokens: Sequence[int], rows: Sequence[int]) -> Any:
        """Run `tokens` from an empty context; float32 logits [len(rows), n_vocab] for the given positions.
        Used by perplexity; the sequence is cleared afterwards."""
        self._check_not_served()
        self.engine.release(_SEQ)
        try:
            out = []
            step = self.config.n_batch
            for start in range(0, len(tokens), step):
                chunk = list(tokens[start : start + step])
                want = [r - start for r in rows if start <= r < start + len(chunk)]
                out.append(self.backend.forward([(_SEQ, chunk)], want))
            import numpy as np

            return np.concatenate(out, axis=0)
        finally:
            self.engine.release(_SEQ)

    def _check_not_served(self) -> None:
        if self._engine is not None and self._engine.on_thread:
            raise InvalidArgumentError("this LLM is being served by an engine thread (the server or AsyncLLM): "
                                       "it evaluates only through requests (generate, stream) until that stops")

    # ---- generation ----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], add_special: bool = True) -> list[int]:
        """A prompt's token ids, checked: text is tokenized; ids must be integers in the vocabulary; the prompt
        must not be empty and must leave room in the context for at least one generated token."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_special=add_special)
        else:
            wrong = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
            if wrong is not None:
                raise InvalidArgumentError(f"a prompt given as a sequence holds token ids (integers), got {wrong!r}")
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.n_vocab]
            if bad:
                raise InvalidArgumentError(f"token id {bad[0]} is out of range for a vocabulary of {self.n_vocab}")
        if not ids:
            raise InvalidArgumentError("the prompt is empty (no tokens to evaluate)")
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens, but the context holds {self.n_ctx} (n_ctx) including at "
                "least one generated token"
            )
        return ids

    def _run(self, prompt: str | Sequence[int], max_tokens: int, params: SamplingParams, stop: str | Sequence[str],
             add_special: bool, cache_prompt: bool, ignore_eos: bool, stream: Stream,
             speculative: Any = True, grammar: Grammar | None = None) -> Iterator[str]:
        """One request through the engine loop, stepped here until it is done. Prompt reuse (cache_prompt) is off
        by default: llama.cpp's kernels (and ours, which follow them bit for bit) sum differently for different
        batch sizes, so evaluating only the new part of a prompt can change the last bits of the logits and, now
        and then, a greedy token. Off, the same prompt always gives the same output."""
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            raise InvalidArgumentError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        gen = GenParams(
            max_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            min_p=params.min_p, seed=params.seed, stop=stop_strings(stop), ignore_eos=ignore_eos,
            cache_prompt=cache_prompt, speculative=_spec_override(speculative), grammar=grammar,
        )
        ids = self.encode_prompt(prompt, add_special)
        engine = self.engine
        if engine.on_thread:  # the server or AsyncLLM runs the loop: this is one more request for its thread
            inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
            req = Request(ids, gen, lambda kind, value: inbox.put((kind, value)))

            def wait() -> list[tuple[str, Any]]:
                return [inbox.get()]
        else:  # step the loop here, on the caller's thread
            events: list[tuple[str, Any]] = []
            req = Request(ids, gen, lambda kind, value: events.append((kind, value)))

            def wait() -> list[tuple[str, Any]]:
                engine.step()
                out = list(events)
                events.clear()
                return out

        engine.add_request(req)
        result: Result | None = None
        try:
            while result is None:
                for kind, value in wait():
                    if kind == "error":
                        raise value
                    if kind == "done":
                        result = value
                    else:
                        yield value[0]
        finally:
            if not req.finished:  # the caller stopped iterating (or an exception left the loop): free the slot now
                engine.abort(req)
                if not engine.on_thread:
                    engine.step()
        stream.result = Completion(
            text=result.text, tokens=result.tokens, prompt_tokens=len(ids), completion_tokens=len(result.tokens),
            finish_reason=result.finish_reason,
            timings=Timings(len(ids), result.prompt_ms, len(result.tokens), result.predicted_ms, result.draft_n,
                            result.draft_n_accepted),
            stopping_word=result.stopping_word,
        )

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        add_special: bool = True,
        cache_prompt: bool = False,
        ignore_eos: bool = False,
        speculative: bool | SpecConfig | dict[str, Any] = True,
        json_schema: dict[str, Any] | str | None = None,
        grammar: str | Grammar | None = None,
        regex: str | None = None,
    ) -> Stream:
        """Generate, yielding text pieces as they complete (never a broken UTF-8 character).
        ignore_eos: keep generating past end-of-generation tokens (benchmarks), as llama.cpp's ignore_eos.
        speculative: where the LLM was made with a draft model or n-gram lookup, False turns it off for this call,
        and a SpecConfig or dict (n_max, n_min, p_min) sets this call's draft lengths.
        Constrained decoding (ninfer.structured), at most one of: json_schema (the output is JSON valid under it),
        grammar (GBNF as llama.cpp's, or Lark; or a Grammar from `compile_grammar`), regex. The output ends when the
        grammar is complete."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        if not isinstance(grammar, Grammar) and (json_schema, grammar, regex) != (None, None, None):
            grammar = self.compile_grammar(json_schema=json_schema, grammar=grammar, regex=regex)
        s = Stream(iter(()))
        gen = self._run(prompt, max_tokens, params, stop, add_special, cache_prompt, ignore_eos, s, speculative,
                        grammar)
        # Validate arguments and evaluate the prompt now, so errors surface at the call, not at the first next().
        first = next(gen, None)
        s._pieces = _chain_first(first, gen)
        return s

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        add_special: bool = True,
        cache_prompt: bool = False,
        ignore_eos: bool = False,
        speculative: bool | SpecConfig | dict[str, Any] = True,
        json_schema: dict[str, Any] | str | None = None,
        grammar: str | Grammar | None = None,
        regex: str | None = None,
    ) -> Completion:
        s = self.stream(
            prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seed=seed, stop=stop, add_special=add_special, cache_prompt=cache_prompt, ignore_eos=ignore_eos,
            speculative=speculative, json_schema=json_schema, grammar=grammar, regex=regex,
        )
        for _ in s:
            pass
        assert s.result is not None  # set by _run when the iteration ends
        return s.result

    def embed(self, text: str | Sequence[int], *, pooling: str = "mean", normalize: bool = True,
              add_special: bool = True) -> np.ndarray:
        """The text's embedding [n_embd] (float32): its tokens' final hidden states after the output norm, pooled
        ("mean" or "last" token) and, with normalize, of unit length -- llama-server's --embeddings. Runs on the
        engine loop like a request (between other requests' steps when served)."""
        ids = self.encode_prompt(text, add_special)
        inbox: queue.SimpleQueue[tuple[Any, Exception | None]] = queue.SimpleQueue()
        job = Job(embed_job(ids, self.config.n_batch, pooling, normalize), lambda r, e: inbox.put((r, e)))
        engine = self.engine
        engine.add_job(job)
        if not engine.on_thread:
            engine.step()
        result, error = inbox.get()
        if error is not None:
            raise error
        return result

    def compile_grammar(self, *, json_schema: Any = None, grammar: str | None = None, regex: str | None = None,
                        lark: str | None = None) -> Grammar:
        """One of json_schema, grammar (GBNF or Lark), regex, lark compiled for this model's vocabulary, to pass
        as `grammar=` to several calls; GrammarError (an InvalidArgumentError) names what is wrong."""
        return Grammar.compile(self.tokenizer, json_schema=json_schema, grammar=grammar, regex=regex, lark=lark)

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_metadata(self.model_file.metadata)
        return self._chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> Completion:
        """Render `messages` with the model's chat template and generate the assistant's reply."""
        prompt = self._chat_prompt(messages)
        # The template already wrote BOS where the model wants one; special-token texts in it are parsed.
        return self.generate(prompt, add_special=False, **kwargs)

    def chat_stream(self, messages: list[dict[str, Any]], **kwargs: Any) -> Stream:
        return self.stream(self._chat_prompt(messages), add_special=False, **kwargs)

    def _chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        if not messages:  # (a template would render only its system preamble, and the model answer nothing asked)
            raise InvalidArgumentError("messages is empty: a chat needs at least one message")
        return self.apply_chat_template(messages)


def _spec_override(speculative: Any) -> bool | SpecConfig:
    if isinstance(speculative, bool | SpecConfig):
        return speculative
    if isinstance(speculative, dict):
        return SpecConfig(**speculative)
    raise InvalidArgumentError(f"speculative must be True, False, a SpecConfig or a dict, got {speculative!r}")


def _chain_first(first: str | None, rest: Generator[str, None, None]) -> Iterator[str]:
    # Closed after the first piece (a caller that stops reading), `rest` has not been entered by `yield from`, so
    # closing this generator would not reach it: its request would run on until the garbage collector found it.
    try:
        if first is not None:
            yield first
        yield from rest
    finally:
        rest.close()

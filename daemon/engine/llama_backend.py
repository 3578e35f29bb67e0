"""The llama.cpp backend: a GGUF file served through llama-cpp-python (no torch).

Same contract as the torch ``Generator``: ``generate(prompt, options, on_text, cancelled,
threads) -> Result``, the R1 chat template taken from the file, the ``<think>`` split, the same
sampling (temperature, then top-p over what is left, then a seeded draw; greedy), the same
statistics. The decode loop is ours, on llama.cpp's public C API, so that the thread count can
change between tokens, cancel is checked after every token, and a shared prompt prefix (a
multi-turn conversation) reuses the KV cache instead of being computed again.

Long native calls (loading, prefill) release the GIL: the worker's command thread keeps answering
health pings meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from dsr1d.engine import pages
from dsr1d.engine.errors import ModelError
from dsr1d.engine.gguf_file import GGUFInfo
from dsr1d.engine.request import (DEFAULTS, OnText, Prompt, Result, check_budget, decode_stats,
                                  messages_of)
from dsr1d.engine.sampling import TokenSampler, allowed_tokens
from dsr1d.textstream import IncrementalDecoder, ThinkSplitter, emit

DEFAULT_CONTEXT = 16384
MEMORY_HEADROOM = 0.9
# llama.cpp sizes its compute buffer for a whole micro-batch's worth of tokens (302 MiB at 512
# for a 152k vocabulary); prefill on a CPU is compute-bound at far fewer tokens, so 128 costs
# it nothing measurable and keeps a quarter of that memory (64 would halve it again at the same
# speed for Q4_0 and BF16, but prefilled Q8_0 5 % slower: 1,267 tokens, 1.5B, 2 cores)
UBATCH = 128
# file types whose big matrices llama.cpp repacks on AVX2 / NEON (int4: Q4_0): its kernels for
# them multiply rows four at a time (see llama_batch.py)
REPACKED_TYPES = ("int4", "Q4_K", "IQ4_NL")
# When a file carries no chat template: DeepSeek-R1's turns (no system prompt, as advised).
R1_USER = "<｜User｜>{content}"
R1_ASSISTANT = "<｜Assistant｜>{content}<｜end▁of▁sentence｜>"
R1_GENERATION = "<｜Assistant｜><think>\n"


def installed() -> bool:
    """Whether llama-cpp-python can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def system_info() -> str:
    """What the llama.cpp build uses on this CPU (``AVX2 = 1 | AVX512 = 0 | …``)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def repacks(file_type: str, info: str, applied: list[str] | None = None) -> bool:
    """Whether llama.cpp (its ``system_info``) repacks the weights of a ``file_type`` file
    (``applied``: the build's `patches`). Not where it has AMX: its AMX buffers take these types
    first, and their kernels do not work in groups of rows (with amx-vnni-rows.patch a step of
    1-8 rows costs more with every row: 29.7, 33.8, 35.8, 38.7, 49.7, 55.0 ms for 1-6 rows of
    the 1.5B in Q4_0). Nor, with that patch, Q4_0 and IQ4_NL on AVX-512 VNNI without AMX: the
    same VNNI kernels take them."""
    if "AMX_INT8 = 1" in info:
        return False
    if "amx-vnni-rows" in (applied or []) and "AVX512_VNNI = 1" in info and \
            file_type.startswith(("int4", "IQ4_NL")):
        return False
    return "REPACK = 1" in info and ("AVX2 = 1" in info or "NEON = 1" in info) and \
        any(file_type.startswith(t) for t in REPACKED_TYPES)


def patches() -> list[str]:
    """The tools/llama-patches/ this llama.cpp build carries ([]: not the project's build)."""
    import llama_cpp.llama_cpp as bindings

    try:
        marker = bindings._lib.llama_dsr1d_patches
    except AttributeError:
        return []
    marker.restype = ctypes.c_char_p
    return marker().decode().split()


def amx_warning(info: str, applied: list[str]) -> str | None:
    """What to say about a build whose ``system_info`` shows AMX without the project's fix
    (``applied``: its `patches`): its int8 kernels crash on the first prompt of two or more
    tokens when GCC 12 built it at -O3, as pip does (llama.cpp #20824)."""
    if "AMX_INT8 = 1" not in info or "amx-tile-config" in applied:
        return None
    return ("warning: this llama.cpp build uses AMX without dsr1d's fix; its int8 kernels crash "
            "(SIGSEGV) on the first prompt when GCC 12 built them (llama.cpp #20824): "
            "make setup builds it with the fix (tools/llama-patches/)")


def build_info() -> str:
    """The binding's version, what its build uses here and its patches, or why it does not
    load."""
    try:
        import llama_cpp

        info, applied = system_info(), patches()
        warning = amx_warning(info, applied)
        return f"llama.cpp {llama_cpp.__version__}: {info}\npatches: " + \
            (", ".join(applied) or "none (not built by tools/llama-wheel.sh)") + \
            (f"\n{warning}" if warning else "")
    except (ImportError, OSError) as exc:  # a wheel built for another CPU, a missing library
        return f"llama-cpp-python is installed but does not load: {exc}"


# ggml.h's enum ggml_log_level (llama-cpp-python's own table of it is out of date).
LOG_WARN, LOG_ERROR = 3, 4


def _quiet_logs(llama_cpp: Any) -> None:
    """llama.cpp logs every tensor to stderr at load; keep warnings and errors only."""
    @llama_cpp.llama_log_callback
    def log(level: int, text: bytes, _user: Any) -> None:
        if level in (LOG_WARN, LOG_ERROR):
            sys.stderr.write(text.decode(errors="replace"))

    _quiet_logs.callback = log  # type: ignore[attr-defined]  # keep it alive for C
    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))


class LlamaGenerator:
    """Generates from one GGUF model, one request at a time."""

    def __init__(self, info: GGUFInfo, threads: int, context: int = 0,
                 use_mmap: bool = False, own_kv: bool = True) -> None:
        import llama_cpp
        from llama_cpp import Llama

        if not info.has_vocab:
            raise ModelError(f"{info.path} has no vocabulary (a shapes-only file): it cannot "
                             f"turn text into tokens")
        self.lib = llama_cpp
        self.info = info
        self.context = effective_context(info, context)
        _quiet_logs(llama_cpp)
        given: list[int] = []
        try:
            # own_kv False: a Batcher holds the KV caches; this context only tokenizes
            with _loading(given):
                self.llm = Llama(model_path=str(info.path),
                                 n_ctx=self.context if own_kv else 64, n_batch=512,
                                 n_ubatch=UBATCH, n_threads=threads, n_threads_batch=threads,
                                 use_mmap=use_mmap, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise ModelError(f"llama.cpp cannot load {info.path}: {exc}") from None
        self.given_back = sum(given)
        # read row by row from the file (a build with tools/llama-patches/lazy-embeddings.patch)
        self.embedding_in_file = info.embedding_bytes if not use_mmap and \
            not info.tied_output and pages.maps_file(info.path) else 0
        self.threads = threads
        self.repacked = repacks(info.file_type, system_info(), patches())
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._buffer = ctypes.create_string_buffer(256)
        # never sampled: the vocabulary's unused tokens
        self.barred = np.array([t for t in range(self.n_vocab) if llama_cpp.llama_vocab_get_attr(
            self.vocab, t) & llama_cpp.LLAMA_TOKEN_ATTR_UNUSED], dtype=np.intp)
        self.allowed = allowed_tokens(self.barred, self.n_vocab)
        self.template = _compile(info.chat_template)
        bos = info.bos_id
        self.bos_text = self.piece(bos, True).decode(errors="replace") if bos is not None else ""

    # -- text <-> tokens ---------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt in the model's chat template, ending with the generation prompt."""
        messages = messages_of(prompt)
        if self.template is None:
            turns = [(R1_ASSISTANT if m["role"] == "assistant" else R1_USER).format(**m)
                     for m in messages if m["role"] != "system"]
            text = self.bos_text + "".join(turns) + R1_GENERATION
        else:
            text = self.template.render(messages=messages, add_generation_prompt=True,
                                        bos_token=self.bos_text)
        return self.tokenize(text)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``, special tokens parsed, no BOS added (templates carry it)."""
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def piece(self, token: int, special: bool) -> bytes:
        """The bytes of one token (special tokens rendered only when ``special``)."""
        key = (token, special)
        if key not in self._pieces:
            buf = self._buffer
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            if n < 0:  # the buffer was too small: -n is what it needs
                buf = ctypes.create_string_buffer(-n)
                n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            self._pieces[key] = buf.raw[:n]
        return self._pieces[key]

    def detokenize(self, tokens: list[int], special: bool = True) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode(errors="replace")

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompt: Prompt, options: dict[str, Any], on_text: OnText | None = None,
                 cancelled: Callable[[], bool] = lambda: False,
                 threads: Callable[[], int | None] = lambda: None) -> Result:
        opts = {**DEFAULTS, **options}
        ids = self.encode(prompt)
        max_new = int(opts["max_new_tokens"])
        check_budget(len(ids), max_new, self.context)
        decoder = IncrementalDecoder(self.detokenize)
        splitter = ThinkSplitter()
        new: list[int] = []
        reason = "length"
        self._set_threads(threads())
        sampler = self.sampler(opts)
        start = time.perf_counter()
        self._prefill(ids)
        token = self._sample(sampler)
        first = time.perf_counter()
        while True:
            if self.lib.llama_vocab_is_eog(self.vocab, token) and not opts["ignore_eos"]:
                reason = "eos"
                break
            new.append(token)
            emit(decoder.push(token), splitter, on_text)
            if len(new) >= max_new:
                break
            if cancelled():
                reason = "cancelled"
                break
            self._set_threads(threads())
            self.llm.eval([token])
            token = self._sample(sampler)
        end = time.perf_counter()
        emit(decoder.flush(), splitter, on_text, final=True)
        stats = {
            **decode_stats(len(ids), len(new), start, first, end),
            "reasoning_chars": len(splitter.reasoning_text),
            "answer_chars": len(splitter.answer_text),
            "finish_reason": reason,
            "dtype": self.info.file_type,
            "threads": self.threads,
            "backend": "llamacpp",
        }
        return Result(self.detokenize(new, special=False), splitter.reasoning_text,
                      splitter.answer_text, stats)

    def logits(self, ids: list[int]) -> list[list[float]]:
        """Logits after each of ``ids`` (for numerical checks against the torch reference)."""
        out = []
        self.llm.n_tokens = 0
        for token in ids:
            self.llm.eval([token])
            out.append(self.row(self.llm.ctx, -1).tolist())
        self.llm.n_tokens = 0  # the next prompt is evaluated from the start
        return out

    def _prefill(self, ids: list[int]) -> None:
        """Evaluate the prompt, reusing the KV cache for the prefix it shares with the last one
        (at least one token is evaluated, so that there are fresh logits to sample from)."""
        cached = self.llm.input_ids[: self.llm.n_tokens]
        common = 0
        for a, b in zip(cached, ids[:-1]):
            if a != b:
                break
            common += 1
        self.llm.n_tokens = common  # eval() drops the KV cache past n_tokens
        self.llm.eval(ids[common:])

    def _sample(self, sampler: TokenSampler) -> int:
        return sampler(self.row(self.llm.ctx, -1))

    def row(self, ctx: Any, index: int) -> Any:
        """The logits of batch row ``index`` of ``ctx`` (-1: the last), a view of llama.cpp's."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx, index),
                                     shape=(self.n_vocab,))

    def sampler(self, opts: dict[str, Any]) -> TokenSampler:
        """A request's sampler (`sampling.TokenSampler`, the rule both backends share), the
        vocabulary's unused tokens barred."""
        return TokenSampler(opts, self.barred, self.allowed)

    def _set_threads(self, wanted: int | None) -> None:
        if wanted and wanted != self.threads:
            self.lib.llama_set_n_threads(self.llm.ctx, wanted, wanted)
            self.threads = wanted


def _compile(template: str | None) -> Any:
    """The file's Jinja chat template, rendered as transformers renders it."""
    if not template:
        return None
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise ModelError(f"the model's chat template does not parse: {exc}") from None


def check_memory(info: GGUFInfo, context: int) -> None:
    """Refuse before loading when the weights, KV cache and buffers would not fit."""
    from dsr1d.engine import memory
    from dsr1d.engine.gguf_file import memory_needed

    need = memory_needed(info, context)
    free, where = memory.available()
    if need > free * MEMORY_HEADROOM:
        raise ModelError(f"{info.path.name} needs about {need / 1e9:.1f} GB at a context of "
                         f"{context} tokens but only {free / 1e9:.1f} GB is {where}; use a "
                         f"smaller quantisation (int4: Q4_0), a shorter engine_context, or a "
                         f"smaller model")


def load(path: Path, threads: int, context: int = 0, use_mmap: bool = False,
         parallel: int = 1) -> LlamaGenerator:
    """Check ``path`` and the memory before llama.cpp sees it (ModelError), then load it;
    ``parallel`` sequences each get the whole context (their KV caches are counted)."""
    from dsr1d.engine.gguf_file import inspect_gguf

    info = inspect_gguf(path)
    check_memory(info, effective_context(info, context) * max(1, parallel))
    return LlamaGenerator(info, threads, context, use_mmap, own_kv=parallel <= 1)


def new_context(model: Any, params: Any, make: Callable[..., Any] | None = None
                ) -> tuple[Any, int]:
    """``llama_init_from_model``, then the KV cache it zero-filled given back (`pages`): the
    context (None where llama.cpp could not make it) and the bytes given back. Only what was
    mapped while the context was made (and the heap) is looked at, never the weights loaded
    before."""
    import llama_cpp.llama_cpp as bindings

    mapped = pages.anon_ranges(heap=False)   # the heap whole: a small cache may reuse its holes
    ctx = (make or bindings.llama_init_from_model)(model, params)
    return ctx, pages.give_back_zero_pages(since=mapped) if ctx else 0


@contextlib.contextmanager
def _loading(given: list[int]) -> Iterator[None]:
    """While llama-cpp-python's ``Llama`` loads (it calls ``llama_cpp.llama_cpp``'s functions):
    the model asks for lazily read tensors (``lazy_mode`` ON: with this project's llama.cpp
    build, the embedding table stays in the file, read row by row; other builds ignore it), and
    the context goes through `new_context`, the bytes given back appended to ``given``."""
    import llama_cpp.llama_cpp as bindings

    defaults, make = bindings.llama_model_default_params, bindings.llama_init_from_model

    def params() -> Any:
        out = defaults()
        out.lazy_mode = bindings.LLAMA_LAZY_MODE_ON
        return out

    def init(model: Any, params: Any) -> Any:
        ctx, size = new_context(model, params, make)
        given.append(size)
        return ctx

    bindings.llama_model_default_params, bindings.llama_init_from_model = params, init
    try:
        yield
    finally:
        bindings.llama_model_default_params, bindings.llama_init_from_model = defaults, make


def effective_context(info: GGUFInfo, requested: int) -> int:
    """The context the engine serves: the request (0: DEFAULT_CONTEXT), at most the model's."""
    return min(requested or DEFAULT_CONTEXT, info.context_length or DEFAULT_CONTEXT)

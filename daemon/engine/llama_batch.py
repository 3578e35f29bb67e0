"""Continuous batching on llama.cpp: several sequences decoded together, one ``llama_decode``
a step.

`Batcher` owns a second llama.cpp context over the loaded model with ``parallel`` sequence
slots (``n_seq_max``; each slot gets the whole configured context). A request joins at the next
step: its prompt is prefilled into a free slot in a call of its own, then every step decodes one
token for every active sequence in one batch and samples each with its own sampler; a sequence
that ends (end of generation, ``max_new_tokens``, cancel) leaves and frees its slot at once.
Each slot remembers the tokens in its KV cache, and a new prompt goes to the free slot sharing
the longest prefix with it, so a shared system prompt or an earlier turn is not evaluated again
(prompt caching). A running sequence's prefix is shared too: its KV cache is copied into the new
request's slot (several users behind one system prompt), and a prompt left with only its last
token to evaluate joins the next step as one more row instead of a call of its own. The last
logits of the ``parallel`` latest prompts are kept (600 KB each for a 152k vocabulary), so the
same prompt again, its KV cache in a free slot or a running one, evaluates nothing at all: its
first token is drawn from them with its own sampler. Text, ``<think>`` split, sampling and
stats are those of `LlamaGenerator.generate`, which serves one request at a time when
``parallel`` is 1.

Rows come in fours where llama.cpp repacks the weights (Q4_0, IQ4_NL, Q4_K on AVX2 / NEON; not
where AMX or the project's VNNI kernels take them: `llama_backend.repacks`): its repacked
kernels multiply four rows at once and each row left over on its own, one more pass
over the weights each. On the 1.5B model in Q4_0 on 2 cores a step of 1, 2, 3, 4, 5, 6, 8 rows
took 25-31, 49, 66, 40, 61, 82, 82 ms. So a step of 4k + 2 or 4k + 3 rows is padded up to a
multiple of four with one throw-away token in each of as many free slots, at the end of what
that slot caches, taken out of its KV cache again after the step (a slot of its own, not a
running sequence's: llama.cpp splits a batch whose sequences have unequal token counts).
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from dsr1d.engine.errors import ModelError
from dsr1d.engine.llama_backend import UBATCH, LlamaGenerator, new_context
from dsr1d.engine.request import DEFAULTS, OnText, Prompt, Result, check_budget, decode_stats
from dsr1d.engine.sampling import TokenSampler
from dsr1d.textstream import IncrementalDecoder, ThinkSplitter, emit

PREFILL_CHUNK = 512
SHARE_MIN = 8          # a shared prefix this much longer than the slot's own is copied over
SHARE_SLACK = 1024     # ...from a sequence no more than this many tokens past it
ROW_GROUP = 4          # rows llama.cpp's repacked kernels take at once
PAD_FROM = 2           # rows left over from which padding to a whole group is faster


@dataclass
class Sequence:
    """One request in a slot."""

    job: int
    slot: int
    ids: list[int]
    opts: dict[str, Any]
    sampler: TokenSampler
    on_text: OnText | None
    cancelled: Callable[[], bool]
    decoder: IncrementalDecoder
    splitter: ThinkSplitter = field(default_factory=ThinkSplitter)
    new: list[int] = field(default_factory=list)
    token: int = -1               # sampled, not yet evaluated
    pos: int = 0                  # where ``token`` goes in the KV cache
    start: float = 0.0
    first: float = 0.0
    cached: int = 0               # prompt tokens found in the slot's KV cache


class Batcher:
    """Continuous batching over a `LlamaGenerator`'s model."""

    def __init__(self, gen: LlamaGenerator, parallel: int) -> None:
        lib = gen.lib
        self.gen, self.lib, self.parallel = gen, lib, parallel
        params = lib.llama_context_default_params()
        params.n_ctx = gen.context * parallel
        params.n_batch = max(PREFILL_CHUNK, parallel)
        params.n_ubatch = max(UBATCH, parallel)
        params.n_seq_max = parallel
        params.n_threads = params.n_threads_batch = gen.threads
        # as LlamaGenerator (llama-cpp-python's default): llama.cpp's automatic choice takes
        # flash attention on a CPU, whose steps at ~1,500 tokens of context took 122 ms for four
        # rows and 57 for one against 113 and 56 without (1.5B Q4_0, 2 cores; equal at ~200)
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        # every slot's KV cache, zero-filled by llama.cpp: given back, resident as it fills
        self.ctx, self.given_back = new_context(gen.llm.model, params)
        if not self.ctx:
            raise ModelError(f"llama.cpp cannot make a context of {parallel} sequences of "
                             f"{gen.context} tokens (memory?)")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(max(PREFILL_CHUNK, parallel), 0, 1)
        self.threads = gen.threads
        self.group = ROW_GROUP if gen.repacked else 1
        self.cached: list[list[int]] = [[] for _ in range(parallel)]   # tokens in each slot
        self.active: dict[int, Sequence] = {}                          # by slot
        self._logits: OrderedDict[tuple[int, ...], Any] = OrderedDict()   # of the latest prompts

    @property
    def free(self) -> list[int]:
        return [s for s in range(self.parallel) if s not in self.active]

    # -- admitting ---------------------------------------------------------------------------

    def admit(self, job: int, prompt: Prompt, options: dict[str, Any], on_text: OnText | None,
              cancelled: Callable[[], bool]) -> list[tuple[int, Result]]:
        """Prefill ``prompt`` into the free slot that shares most of it; InvalidRequest when it
        cannot be served. Returns the jobs that ended already (a one-token answer)."""
        opts = {**DEFAULTS, **options}
        ids = self.gen.encode(prompt)
        check_budget(len(ids), int(opts["max_new_tokens"]), self.gen.context)
        start = time.perf_counter()
        # a prompt seen lately left its last logits: then the whole prompt is worth finding
        logits = self._logits.get(tuple(ids))
        want = ids if logits is not None else ids[:-1]
        slot, common = max(((s, _common(self.cached[s], want)) for s in self.free),
                           key=lambda sc: sc[1])
        common = self._share(slot, want, common)
        self.lib.llama_memory_seq_rm(self.memory, slot, common, -1)
        self.cached[slot] = ids[:common]
        seq = Sequence(job, slot, ids, opts, self.gen.sampler(opts), on_text, cancelled,
                       IncrementalDecoder(self.gen.detokenize), start=start, cached=common)
        self.active[slot] = seq
        if logits is not None and common == len(ids):
            # nothing to evaluate: the first token is drawn (with this request's own sampler)
            # from the logits the same prompt left
            seq.pos, seq.token = common, seq.sampler(logits)
            seq.first = time.perf_counter()
            return self._advance([seq])
        if common == len(ids) - 1:
            # only the last prompt token is left: it is a row of the next step, decoded with
            # every running sequence's token in one call, not a call of its own
            seq.token, seq.pos = ids[-1], common
            return []
        for begin in range(common, len(ids), PREFILL_CHUNK):
            chunk = ids[begin:begin + PREFILL_CHUNK]
            last = begin + len(chunk) == len(ids)
            self._fill([(t, begin + i, slot, last and i == len(chunk) - 1)
                        for i, t in enumerate(chunk)])
            self._decode()
        self.cached[slot] = list(ids)
        self._keep_logits(ids, self.batch.n_tokens - 1)
        seq.pos = len(ids)
        seq.token = self._sample(seq, self.batch.n_tokens - 1)
        seq.first = time.perf_counter()
        return self._advance([seq])

    # -- one step ----------------------------------------------------------------------------

    def step(self, threads: int | None = None) -> list[tuple[int, Result]]:
        """Decode one token of every active sequence; the jobs that ended, with their results."""
        if threads and threads != self.threads:
            self.lib.llama_set_n_threads(self.ctx, threads, threads)
            self.threads = threads
        running = list(self.active.values())
        pads = self._padding(len(running), running[0].token if running else 0)
        self._fill([(s.token, s.pos, s.slot, True) for s in running] + pads)
        try:
            self._decode()
        finally:
            for _, pos, slot, _ in pads:
                self.lib.llama_memory_seq_rm(self.memory, slot, pos, -1)
        now = time.perf_counter()
        for i, seq in enumerate(running):
            self.cached[seq.slot].append(seq.token)
            seq.pos += 1
            seq.token = self._sample(seq, i)
            seq.first = seq.first or now
        return self._advance(running)

    def _padding(self, rows: int, token: int) -> list[tuple[int, int, int, bool]]:
        """Throw-away rows that make ``rows`` a whole number of groups, one in each of as many
        free slots with room left; none when that is not worth it or not possible."""
        if rows % self.group < PAD_FROM:
            return []
        short = self.group - rows % self.group
        room = [s for s in self.free if len(self.cached[s]) < self.gen.context]
        if len(room) < short:
            return []
        return [(token, len(self.cached[s]), s, False) for s in room[:short]]

    def _share(self, slot: int, prefix: list[int], have: int) -> int:
        """Copy into ``slot`` the KV cache of the running sequence sharing most of ``prefix``
        when that beats the ``have`` tokens ``slot`` holds already (several users, one system
        prompt; the same question twice at once); how many tokens of it ``slot`` now holds."""
        best, common = -1, have
        for other, seq in self.active.items():
            n = _common(self.cached[other], prefix)
            # the copy takes the whole sequence, so not one that has run on far past its prompt
            if n >= common + SHARE_MIN and len(self.cached[other]) <= n + SHARE_SLACK:
                best, common = other, n
        if best < 0:
            return have
        lib, ctx = self.lib, self.ctx
        size = lib.llama_state_seq_get_size(ctx, best)
        buf = (ctypes.c_uint8 * size)()
        written = lib.llama_state_seq_get_data(ctx, buf, size, best)
        lib.llama_memory_seq_rm(self.memory, slot, -1, -1)
        if not written or lib.llama_state_seq_set_data(ctx, buf, written, slot) != written:
            lib.llama_memory_seq_rm(self.memory, slot, -1, -1)
            self.cached[slot] = []
            return 0
        return common

    def _advance(self, running: list[Sequence]) -> list[tuple[int, Result]]:
        """Take each sequence's sampled token; the ones that end leave."""
        done = []
        for seq in running:
            reason = None
            if self.lib.llama_vocab_is_eog(self.gen.vocab, seq.token) and \
                    not seq.opts["ignore_eos"]:
                reason = "eos"
            else:
                seq.new.append(seq.token)
                emit(seq.decoder.push(seq.token), seq.splitter, seq.on_text)
                if len(seq.new) >= int(seq.opts["max_new_tokens"]):
                    reason = "length"
                elif seq.cancelled():
                    reason = "cancelled"
            if reason is not None:
                done.append((seq.job, self._finish(seq, reason)))
        return done

    def _finish(self, seq: Sequence, reason: str) -> Result:
        end = time.perf_counter()
        del self.active[seq.slot]
        emit(seq.decoder.flush(), seq.splitter, seq.on_text, final=True)
        stats = {
            **decode_stats(len(seq.ids), len(seq.new), seq.start, seq.first, end),
            "reasoning_chars": len(seq.splitter.reasoning_text),
            "answer_chars": len(seq.splitter.answer_text),
            "finish_reason": reason, "dtype": self.gen.info.file_type,
            "threads": self.threads, "backend": "llamacpp", "slot": seq.slot,
            "batch": len(self.active) + 1, "cached_prompt_tokens": seq.cached,
        }
        return Result(self.gen.detokenize(seq.new, special=False), seq.splitter.reasoning_text,
                      seq.splitter.answer_text, stats)

    # -- llama.cpp ---------------------------------------------------------------------------

    def _fill(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, wants logits) into the batch."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(tokens)

    def _decode(self) -> None:
        code = self.lib.llama_decode(self.ctx, self.batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} (the KV cache is full?)")

    def _sample(self, seq: Sequence, index: int) -> int:
        return seq.sampler(self.gen.row(self.ctx, index))

    def _keep_logits(self, ids: list[int], index: int) -> None:
        """Keep a copy of the logits a prefill left (the ``parallel`` latest prompts)."""
        key = tuple(ids)
        self._logits[key] = self.gen.row(self.ctx, index).copy()
        self._logits.move_to_end(key)
        while len(self._logits) > self.parallel:
            self._logits.popitem(last=False)

    def close(self) -> None:
        self.active.clear()
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


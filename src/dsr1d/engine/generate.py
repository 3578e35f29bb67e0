"""The decode loop: chat template, prefill, token-by-token decode with a KV cache, sampling,
streaming, cancel, and the statistics people ask for (first-token latency, decode tokens/s,
reasoning/answer split)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from dsr1d.engine.model import Loaded
from dsr1d.engine.request import (DEFAULTS, InvalidRequest, OnText, Prompt, Result, check_budget,
                                  decode_stats, messages_of)
from dsr1d.engine.sampling import NOTHING_BARRED, TokenSampler
from dsr1d.textstream import IncrementalDecoder, ThinkSplitter, emit

__all__ = ["DEFAULTS", "Generator", "InvalidRequest", "Result"]


class Generator:
    """Generates from one loaded model, one request at a time."""

    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.vocab = len(self.tokenizer)
        eos = self.tokenizer.eos_token_id
        self.stop_ids = {eos} if isinstance(eos, int) else set(eos or [])
        self.threads: int | None = None

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt in the model's chat template, ending with the generation prompt."""
        ids = self.tokenizer.apply_chat_template(messages_of(prompt),
                                                 add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def generate(self, prompt: Prompt, options: dict[str, Any], on_text: OnText | None = None,
                 cancelled: Callable[[], bool] = lambda: False,
                 threads: Callable[[], int | None] = lambda: None) -> Result:
        opts = {**DEFAULTS, **options}
        ids = self.encode(prompt)
        check_budget(len(ids), int(opts["max_new_tokens"]), self.loaded.context)
        sampler = TokenSampler(opts, NOTHING_BARRED)
        decoder = IncrementalDecoder(lambda t: self.tokenizer.decode(t, skip_special_tokens=False))
        splitter = ThinkSplitter()
        new: list[int] = []
        reason = "length"
        self._set_threads(threads())
        with torch.inference_mode():
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            start = time.perf_counter()
            logits = self._step(torch.tensor([ids]), cache)
            token = self._draw(sampler, logits)
            first = time.perf_counter()
            while True:
                if token in self.stop_ids and not opts["ignore_eos"]:
                    reason = "eos"
                    break
                new.append(token)
                emit(decoder.push(token), splitter, on_text)
                if len(new) >= opts["max_new_tokens"]:
                    break
                if cancelled():
                    reason = "cancelled"
                    break
                self._set_threads(threads())
                token = self._draw(sampler, self._step(torch.tensor([[token]]), cache))
            end = time.perf_counter()
        emit(decoder.flush(), splitter, on_text, final=True)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        stats = {
            **decode_stats(len(ids), len(new), start, first, end),
            "reasoning_chars": len(splitter.reasoning_text),
            "answer_chars": len(splitter.answer_text),
            "finish_reason": reason,
            "dtype": self.loaded.dtype,
            "threads": torch.get_num_threads(),
            "backend": "torch",
        }
        return Result(text, splitter.reasoning_text, splitter.answer_text, stats)

    def _step(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=input_ids, cache=cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[0, -1]

    def _draw(self, sampler: TokenSampler, logits: torch.Tensor) -> int:
        # rows past the tokenizer's vocabulary are padding in R1 checkpoints: never sampled
        return sampler(logits[: self.vocab].float().numpy())

    def _set_threads(self, wanted: int | None) -> None:
        if wanted and wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)

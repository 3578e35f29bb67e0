"""What a generation request asks for and what it returns, shared by both backends (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

# DeepSeek's guidance for R1: temperature 0.6, top-p 0.95, no system prompt.
DEFAULTS = {"max_new_tokens": 512, "temperature": 0.6, "top_p": 0.95, "greedy": False,
            "seed": -1, "ignore_eos": False}

OnText = Callable[[str], None]
# A prompt is one user turn, or a conversation: [{"role": "user"|"assistant"|"system",
# "content": "…"}, …] ending with the user's turn.
Prompt = Union[str, list]


def messages_of(prompt: Prompt) -> list[dict[str, str]]:
    """The conversation a prompt stands for."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def model_sampling(values: dict[str, Any]) -> dict[str, float]:
    """The model's own sampling defaults (``generation_config.json``'s ``temperature`` and
    ``top_p``, or a GGUF's ``general.sampling.*``), where they are sane; they replace DeepSeek's
    guidance in `DEFAULTS` for this model, and a request's options replace them."""
    out: dict[str, float] = {}
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 1e-6, 1.0)):
        value = values.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi:
            out[key] = float(value)
    return out


class InvalidRequest(Exception):
    """The request cannot be served as asked (too long, bad option)."""


@dataclass
class Result:
    """The generated text, split at ``</think>``, and the statistics people ask for."""

    text: str
    reasoning: str
    answer: str
    stats: dict[str, Any] = field(default_factory=dict)


def check_budget(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """InvalidRequest when the prompt and the new tokens do not fit the context."""
    if prompt_tokens + max_new_tokens > context:
        raise InvalidRequest(f"the prompt is {prompt_tokens} tokens; with max_new_tokens "
                             f"{max_new_tokens} that exceeds the model's context of "
                             f"{context} tokens")


def decode_stats(prompt_tokens: int, new_tokens: int, start: float, first: float,
                 end: float) -> dict[str, Any]:
    """Timing statistics of one generation (perf_counter seconds); the first token is prefill."""
    decode_tokens = max(new_tokens - 1, 0)
    rate = decode_tokens / (end - first) if end > first and decode_tokens else 0.0
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "first_token_latency_s": first - start, "decode_tokens_per_s": rate,
            "total_s": end - start}

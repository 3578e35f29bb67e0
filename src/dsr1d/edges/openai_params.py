"""Which request fields each endpoint passes to llama-server: the ones it honours, no others.

llama-server ignores a field it does not know (HTTP 200, nothing done), so the front refuses
anything not listed here with a 400 that names it: nothing is accepted and then ignored. The
lists follow llama-server's completion schema (``tools/server/server-schema.cpp``) and its
OpenAI adapters (``server-common.cpp``) in the llama.cpp tree dsr1d builds.
"""

from __future__ import annotations

from dsr1d.table import clip

# llama-server's sampling and generation fields, shared by chat and raw completions.
SAMPLING = frozenset({
    "stream", "stream_options", "timings_per_token", "cache_prompt", "return_tokens",
    "return_progress", "n_predict", "max_tokens", "max_completion_tokens", "n_indent", "n_keep",
    "n_discard", "n", "n_cmpl", "n_cache_reuse", "t_max_predict_ms", "response_fields",
    "top_k", "top_p", "min_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "typical_p",
    "temperature", "dynatemp_range", "dynatemp_exponent", "repeat_last_n", "repeat_penalty",
    "frequency_penalty", "presence_penalty", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta",
    "seed", "n_probs", "min_keep", "post_sampling_probs", "json_schema", "grammar",
    "logit_bias", "ignore_eos", "stop", "samplers", "id_slot", "model",
})

CHAT = SAMPLING | {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "logprobs",
    "top_logprobs", "chat_template_kwargs", "reasoning_format", "add_generation_prompt",
    "continue_final_message", "reasoning_budget_tokens",
}

COMPLETIONS = SAMPLING | {"prompt", "logprobs", "response_format"}

EMBEDDINGS = frozenset({"input", "model", "encoding_format", "content"})
TOKENIZE = frozenset({"content", "add_special", "parse_special", "with_pieces"})
DETOKENIZE = frozenset({"tokens"})

# What llama-server cannot honour, with the reason the caller gets.
REFUSED = {
    "echo": "echo is not supported (llama-server returns only the completion)",
    "suffix": "suffix is not supported here (fill-in-the-middle: send the prompt with the "
              "model's FIM tokens)",
    "best_of": "best_of is not supported",
    "functions": "functions is the deprecated form of tools: send tools",
    "function_call": "function_call is the deprecated form of tool_choice: send tool_choice",
    "dimensions": "dimensions is not supported: the model's embedding size is fixed",
}

ENDPOINT_FIELDS: dict[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset(CHAT), "/v1/completions": frozenset(COMPLETIONS),
    "/v1/embeddings": EMBEDDINGS, "/tokenize": TOKENIZE, "/detokenize": DETOKENIZE,
}


def unsupported(path: str, body: dict) -> tuple[str, str] | None:
    """The first field of ``body`` that ``path`` does not honour, with the reason; or None."""
    allowed = ENDPOINT_FIELDS[path]
    for key in body:
        if key in REFUSED and key not in allowed:
            return key, REFUSED[key]
        if key not in allowed:
            return clip(key), f"{clip(key)!r} is not a parameter of {path} here (nothing is " \
                              f"accepted and then ignored)"
    return None

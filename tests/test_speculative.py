"""Speculative decoding through the daemon's API, on SmolLM2-135M-Instruct: a draft model
(here the model itself: same tokenizer, every draft accepted) and n-gram drafting each give the
same greedy answer as no speculation, and the server really drafted (its own timings say so)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import eventually  # noqa: E402
from engine_fixtures import engine_daemon_running  # noqa: E402

pytest_plugins = ["daemon_fixtures", "engine_fixtures"]

PROMPT = [{"role": "user", "content": "Name three primary colours and say why."}]
# Repetitive raw text, so n-gram drafting finds its continuation in what was already said.
WEEK = ", ".join(["monday tuesday wednesday thursday friday saturday sunday"] * 3) + \
    ", monday tuesday"
TOKENS = 48


def post(sock: Path, path: str, body: dict) -> dict:
    out = subprocess.run(["curl", "-s", "--unix-socket", str(sock), f"http://dsr1d{path}",
                          "-H", "Content-Type: application/json", "--data-binary", "@-"],
                         input=json.dumps(body).encode(), capture_output=True,
                         timeout=120).stdout
    return json.loads(out)


def served(tmp_path: Path, model: Path, name: str, *extra: str) -> tuple[dict, dict, str]:
    """A chat answer and a raw completion (greedy, TOKENS each), and the daemon's log."""
    sock = tmp_path / f"{name}.sock"
    with engine_daemon_running(tmp_path / name, model,
                               extra_config=["engine_context = 1024", *extra, "[api]",
                                             f"socket = {sock}"]) as daemon:
        daemon.wait_state("ready")
        eventually(sock.exists, what="the API socket")
        chat = post(sock, "/v1/chat/completions", {"messages": PROMPT, "temperature": 0,
                                                    "max_tokens": TOKENS})
        raw = post(sock, "/v1/completions", {"prompt": WEEK, "temperature": 0,
                                             "max_tokens": TOKENS})
        return chat, raw, daemon.daemon.log()


def test_a_draft_model_and_ngrams_keep_the_greedy_answer(smollm2: Path, tmp_path: Path) -> None:
    plain, plain_raw, plain_log = served(tmp_path, smollm2, "plain")
    drafted, drafted_raw, draft_log = served(tmp_path, smollm2, "draft",
                                             f"draft_model = {smollm2}", "draft_max = 4")
    ngram_chat, ngram, ngram_log = served(tmp_path, smollm2, "ngram", "draft_model = ngram")
    text = plain["choices"][0]["message"]["content"]
    week = plain_raw["choices"][0]["text"]
    assert len(text) > 40 and "wednesday" in week
    for chat, raw in ((drafted, drafted_raw), (ngram_chat, ngram)):
        assert chat["choices"][0]["message"]["content"] == text
        assert raw["choices"][0]["text"] == week
    assert "speculative decoding: off" in plain_log and "draft_n" not in plain["timings"]
    assert "speculative decoding: draft SmolLM2-135M-Instruct.Q4_1" in draft_log
    # the model drafting for itself: drafts were made, and (same weights) nearly all accepted
    assert drafted["timings"]["draft_n"] >= TOKENS // 2
    assert drafted["timings"]["draft_n_accepted"] >= drafted["timings"]["draft_n"] * 0.8
    assert "speculative decoding: ngram" in ngram_log
    assert ngram["timings"].get("draft_n", 0) > 0


def test_a_draft_model_that_is_missing_is_said_and_retried(smollm2: Path, tmp_path: Path) -> None:
    with engine_daemon_running(tmp_path / "missing", smollm2,
                               extra_config=["draft_model = /nonexistent/draft.gguf"]) as daemon:
        daemon.wait_state("restarting")
        assert "/nonexistent/draft.gguf" in daemon.daemon.log()

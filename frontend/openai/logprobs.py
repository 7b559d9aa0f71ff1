"""The generate interface's ``logprobs`` entries (``backend.engine.logprobs``) in OpenAI's shapes, as vLLM's own
OpenAI server builds them from the same engine output.

Chat (``choices[i].logprobs``, whole answers and each stream chunk): ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}``; ``bytes`` are the token's UTF-8
bytes. Completions (the legacy form): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...],
"text_offset"}``, the offsets counted in characters from the completion's start (across a stream's chunks).

Which tokens are "top", as vLLM's server answers (read in vLLM 0.32's ``serving.py`` of chat and completions): per
step vLLM holds the sampled token first, then the ``k`` most likely in rank order (the sampled token once); chat's
``top_logprobs`` are the first ``k`` of those, completions' the whole dict (``k`` + 1 when the sampled token is not
among the ``k``). Greedy, the sampled token is the most likely, so both are the ``k`` most likely in rank order;
sampling with a temperature, the sampled token may lead the list.
"""
from __future__ import annotations

from typing import Any


def _by_vllm(entry: dict) -> list[dict]:
    """vLLM's per-step order: the sampled token, then the top tokens by rank without it."""
    return [entry, *(top for top in entry["top_logprobs"] if top["token_id"] != entry["token_id"])]


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _chat_entry(entry: dict) -> dict[str, Any]:
    top = _by_vllm(entry)[:len(entry["top_logprobs"])]
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": _bytes(entry["token"]),
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t["token"])} for t in top]}


def chat(entries: list[dict]) -> dict[str, Any]:
    """A chat choice's ``logprobs`` for the tokens ``entries``."""
    return {"content": [_chat_entry(entry) for entry in entries], "refusal": None}


def completion(entries: list[dict], offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs`` for the tokens ``entries``, the first at character ``offset`` of the text."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": [entry["token"] for entry in entries], "token_logprobs": [entry["logprob"] for entry in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in _by_vllm(entry)} for entry in entries],
            "text_offset": offsets}


def text_length(entries: list[dict]) -> int:
    """How many characters of a completion's text ``entries``' tokens span (the next chunk's first offset)."""
    return sum(len(entry["token"]) for entry in entries)

"""vLLM's sample log probabilities as the generate interface's ``logprobs`` output.

A request whose sampling parameters ask for ``logprobs: k`` (vLLM's ``SamplingParams.logprobs``: the k most likely
tokens at each step, 0 for the sampled token alone, -1 for the whole vocabulary) gets, on every response, one entry
per token that response carries, in order::

    {"token_id": 1234, "token": " cat", "logprob": -0.12, "rank": 1,
     "top_logprobs": [{"token_id": 1234, "token": " cat", "logprob": -0.12}, ...]}   # the k most likely, by rank

``token`` is the token as vLLM decodes it on its own (``Logprob.decoded_token``; the tokenizer's ``decode`` where vLLM
gave none), so the tokens of a response join to its text, except that the bytes of a character are "" until the token
that completes it, bytes that form no character stay "" where the text shows U+FFFD, and a stop string may cut the
text. ``rank`` is the sampled token's rank in the vocabulary (1: the most likely). Log probabilities
are vLLM's (its ``logprobs_mode``, raw by default), floored at -9999.0 as OpenAI and vLLM's server do, so the JSON
carries no infinity.

vLLM hands each step's log probabilities over as one ``{token_id: Logprob}`` dict: the sampled token first, then the
top k in rank order, the sampled token once only (where it is among the top k, its entry is there with its rank). The
top k are read back from that dict here; ``frontend.openai.logprobs`` rebuilds vLLM's order from them.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

FLOOR = -9999.0  # OpenAI's and vLLM's stand-in for -inf


def _floor(value: float) -> float:
    return max(float(value), FLOOR)


def token_entries(token_ids: Iterable[int], positions: Iterable[Mapping[int, Any] | None] | None, top: int,
                  decode: Callable[[int], str]) -> list[dict]:
    """The entries of the tokens ``token_ids``; ``positions``: vLLM's logprobs of the same tokens (a
    ``CompletionOutput``'s ``logprobs``, ``{token_id: Logprob}`` per token), ``top``: the ``logprobs`` asked for,
    ``decode``: a token id's text where vLLM decoded none. A token vLLM gave no logprobs for (it should not happen) gets
    the floor and no top tokens, as vLLM's server answers it."""
    token_ids = list(token_ids)
    positions = list(positions) if positions is not None else [None] * len(token_ids)
    if len(positions) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens but logprobs for {len(positions)}")
    return [_entry(token_id, position, top, decode) for token_id, position in zip(token_ids, positions)]


def _entry(token_id: int, position: Mapping[int, Any] | None, top: int, decode: Callable[[int], str]) -> dict:
    sampled = None if position is None else position.get(token_id)
    if sampled is None:
        return {"token_id": token_id, "token": decode(token_id), "logprob": FLOOR, "rank": None, "top_logprobs": []}
    items = list(position.items())
    # the sampled token among the top k: the dict holds the top k alone (its entry carries its rank); else it is
    # the extra first entry
    ranked = sorted(items, key=lambda item: item[1].rank) if top == -1 or len(items) <= top else items[1:]
    return {"token_id": token_id, "token": _text(token_id, sampled, decode), "logprob": _floor(sampled.logprob),
            "rank": sampled.rank,
            "top_logprobs": [{"token_id": tid, "token": _text(tid, lp, decode), "logprob": _floor(lp.logprob)}
                             for tid, lp in ranked]}


def _text(token_id: int, logprob, decode: Callable[[int], str]) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else decode(token_id)

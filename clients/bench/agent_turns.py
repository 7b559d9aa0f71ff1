"""The agent-loop benchmark's conversations and its one client (``clients.bench.agent_loop``): what an agent framework
sends through the official ``openai`` SDK (``AsyncOpenAI``), the same bytes to every server.

A conversation (``Conversation``) is a computer-use agent's: a system prompt, the task with the first screenshot, then
per step the assistant's tool call (``click``, fixed text: the same history on every server whatever the model
answered), the tool's result (``role: tool``) and the next screenshot in a user turn. Turn ``k`` (1-based) sends that
whole history with ``k`` screenshots, ``tools`` and ``tool_choice: auto``, ``session_id`` (vLLM's extra field: ours
keeps the conversation's items across turns, vLLM's server takes and ignores it), greedy ``max_tokens`` with
``ignore_eos``, streamed with ``stream_options.include_usage``. Screenshots are drawn (``clients.images.screenshot``)
from the conversation's seed, PNG.

The client (``ask``) measures TTFT as the time to the first chunk carrying text or a tool-call delta, and reads the
last chunk's ``usage``: ``prompt_tokens``, ``prompt_tokens_details.cached_tokens`` (vLLM's server: with
``--enable-prompt-tokens-details``) and ours' extension ``epd_media {items, reused, encoded}``.

Background traffic (``Background``): closed-loop requests of one new screenshot and a long text (other users' work
that evicts the ordinary caches: the engines' prefix caches, the encoder's cache, the consumer's recent items), no
session, one output token.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from clients.bench.side_client import data_url

TOOLS = [{"type": "function", "function": {
    "name": "click", "description": "Click the screen at a point.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                   "required": ["x", "y"]}}},
    {"type": "function", "function": {
        "name": "type_text", "description": "Type text into the focused field.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
SYSTEM = "You operate a computer through tools. After each action you get the tool's result and a new screenshot."
CONVERSATION_SEEDS = 50_000_000  # conversation i's screenshot j: seed + i * 1000 + j
BACKGROUND_SEEDS = 60_000_000
WARM_SEEDS = 70_000_000


@dataclass
class Conversation:
    """Conversation ``index`` of a run: screenshots of ``size`` drawn from its seeds, its ``session`` id."""

    index: int
    size: tuple[int, int]
    session: str
    shots: dict[int, str] = field(default_factory=dict)  # screenshot j -> its data URL

    def screenshot(self, j: int) -> str:
        from clients.images import screenshot_bytes

        if j not in self.shots:
            self.shots[j] = data_url(screenshot_bytes(*self.size, seed=CONVERSATION_SEEDS + self.index * 1000 + j))
        return self.shots[j]

    def messages(self, k: int) -> list[dict]:
        """Turn ``k``'s messages: the history with screenshots 1..k (module docstring)."""
        out = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": [{"type": "text", "text": f"Task {self.index}: file the expense report."},
                                            {"type": "image_url", "image_url": {"url": self.screenshot(1)}}]}]
        for j in range(1, k):
            call = {"id": f"call_{self.index}_{j}", "type": "function",
                    "function": {"name": "click", "arguments": json.dumps({"x": 40 * j, "y": 30 * j})}}
            out += [{"role": "assistant", "content": f"Step {j}.", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": f"clicked ({40 * j}, {30 * j}): ok"},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": self.screenshot(j + 1)}},
                                                 {"type": "text", "text": f"Screenshot after step {j}. Next?"}]}]
        return out


@dataclass
class Answer:
    """One turn's answer: TTFT (s; None without any), ``usage`` as a dict (None if none came), the error if any."""

    ttft: float | None
    usage: dict | None
    error: str | None = None


async def ask(client, model: str, messages: list[dict], max_tokens: int, session: str | None = None,
              tools: bool = True) -> Answer:
    """One streamed chat completion through ``client`` (``openai.AsyncOpenAI``); errors come back in the answer."""
    extra = {"ignore_eos": True, **({"session_id": session} if session else {})}
    more = {"tools": TOOLS, "tool_choice": "auto"} if tools else {}
    started, ttft, usage = time.monotonic(), None, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra, **more)
        async for chunk in stream:
            if ttft is None and chunk.choices:  # the first choice chunk: side_client.first_token_event's rule
                ttft = time.monotonic() - started
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
    except Exception as exc:  # noqa: BLE001  the SDK's errors, the connection's: counted, not fatal
        return Answer(ttft, usage, f"{type(exc).__name__}: {str(exc)[:300]}")
    return Answer(ttft, usage)


@dataclass
class Background:
    """Closed-loop traffic of ``concurrency`` clients: one new screenshot of ``size`` and ``words`` words each."""

    concurrency: int
    size: tuple[int, int]
    words: int
    sent: int = 0

    def messages(self) -> list[dict]:
        from clients.images import screenshot_bytes

        seed, self.sent = BACKGROUND_SEEDS + self.sent, self.sent + 1
        text = " ".join(f"w{(seed * 7 + i) % 997}" for i in range(self.words))
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(
            screenshot_bytes(*self.size, seed=seed))}}, {"type": "text", "text": text}]}]

    async def run(self, client, model: str, seconds: float) -> dict:
        """Requests for ``seconds``: how many were answered and failed, their prompt tokens."""
        deadline, tally = time.monotonic() + seconds, {"requests": 0, "errors": 0, "prompt_tokens": 0}

        async def one_client() -> None:
            while time.monotonic() < deadline:
                got = await ask(client, model, self.messages(), 1, tools=False)
                tally["errors" if got.error else "requests"] += 1
                tally["prompt_tokens"] += (got.usage or {}).get("prompt_tokens") or 0

        await asyncio.gather(*(one_client() for _ in range(self.concurrency)))
        return tally


def warm_messages(size: tuple[int, int], i: int) -> list[dict]:
    """A warm-up request of its own screenshot (first-request costs paid before turn 1)."""
    from clients.images import screenshot_bytes

    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(
        screenshot_bytes(*size, seed=WARM_SEEDS + i))}}, {"type": "text", "text": "What is on the screen?"}]}]

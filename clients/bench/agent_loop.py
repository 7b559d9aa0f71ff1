"""Agent-loop benchmark (issue 41, part 5): agents' conversations through the OpenAI endpoint with the official
``openai`` SDK, against vLLM's own ``vllm serve`` of the same checkpoint with the same engine settings, the same client
and the same conversations; one per-turn table (markdown and JSON) in one run.

    .venv/bin/python -m clients.bench.agent_loop                                   # K=8, 30 s pauses (~12 min)
    .venv/bin/python -m clients.bench.agent_loop --turns 3 --pause-s 2 --out .cache/agent-loop-quick

``--conversations`` agents at once, ``--turns`` turns each (``clients.bench.agent_turns``: turn k sends the history
with k drawn ``--screenshot`` screenshots, the assistant's tool calls and the tools' results, ``tools``,
``session_id``);
every conversation's turn k is sent at once, then the tool pause: ``--pause-s`` seconds of background traffic (new
screenshots with long texts, ``--background-concurrency`` clients) that evicts the ordinary caches. The stacks, one
after the other (never both on the machine): ``vllm`` (vLLM's OpenAI API server, what ``vllm serve`` runs, with the
topology's ``llm`` engine settings, ``--enable-auto-tool-choice --tool-call-parser hermes
--enable-prompt-tokens-details``) and ``ours`` (tritonserver on ``--topology`` rendered for ``--deployment`` alone,
its ``reuse`` block keeping a conversation's items for ``session_seconds``, behind ``frontend.openai`` with the
checkpoint's tokenizer for the tools). Both get ``limits.max_images`` = ``--turns`` (the engines'
``limit_mm_per_prompt``); ours' recent-items budget is cut to ``--held-kib`` (so the background evicts what no
conversation keeps, as it evicts vLLM's prefix cache).

Per turn: TTFT p50/p90 over the conversations, each stack; ours' encodes (the encoder's ``epd_encoder_items_total``
moved over the turn, read once the counters settle) and ``usage.epd_media``; ``cached_tokens`` both (the table:
``clients.bench.agent_table``). The load average of the machine is recorded before and after each stack.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from backend.deploy.local_server import ROOT
from clients.bench import agent_table as table, side_stacks as stacks
from clients.bench.agent_turns import Background, Conversation, ask, warm_messages

COUNTERS = ("epd_encoder_items_total", "epd_encoder_cache_hits_total")
VLLM_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prompt-tokens-details")


def size(text: str) -> tuple[int, int]:
    """``1280x720`` -> (1280, 720) (argparse type)."""
    try:
        width, height = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxH, got {text!r}") from None
    if min(width, height) < 28:
        raise argparse.ArgumentTypeError(f"expected WxH of at least 28x28, got {text!r}")
    return width, height


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=8, help="turns per conversation (1-16)")
    p.add_argument("--conversations", type=int, default=4, help="agents at once")
    p.add_argument("--pause-s", type=float, default=30.0, help="the tool pause between turns (background traffic)")
    p.add_argument("--screenshot", type=size, default=(1280, 720), help="the screenshots' WxH")
    p.add_argument("--max-tokens", type=int, default=8, help="each turn's answer (greedy, ignore_eos)")
    p.add_argument("--background-concurrency", type=int, default=2, help="background clients in a pause")
    p.add_argument("--background-words", type=int, default=400, help="words of a background request's text")
    p.add_argument("--held-kib", type=int, default=256, help="ours' reuse.held_bytes: the recent-items budget (KiB)")
    p.add_argument("--warmup", type=int, default=4, help="requests of their own screenshot before turn 1")
    p.add_argument("--topology", type=Path, default=ROOT / "topologies" / "cpu-reuse.yaml",
                   help="a topology with a reuse: block; both sides' engine settings")
    p.add_argument("--deployment", choices=("epd", "epd_disagg"), default="epd", help="ours")
    p.add_argument("--orchestrator", choices=("colocated", "proxy"), default="colocated",
                   help="ours' orchestrator: beside the engine that consumes the embeddings (pd's; E/P/D: prefill's, "
                        "with decode's engine in that process too), or a model of its own")
    p.add_argument("--endpoint", choices=("in-process", "separate"), default="in-process",
                   help="ours' OpenAI endpoint: in the served model's process (openai_port) or frontend.openai")
    p.add_argument("--stacks", default=f"{table.VLLM},{table.OURS}", help="which to run, in order")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=ROOT / ".cache" / "agent-loop", help="table.md, results.json")
    p.add_argument("--logs", type=Path, default=ROOT / ".cache" / "agent-loop-logs", help="the servers' logs")
    args = p.parse_args(argv)
    if not 1 <= args.turns <= 16:
        p.error(f"--turns: 1 to 16, got {args.turns}")
    for name in ("conversations", "max_tokens", "background_concurrency", "background_words", "held_kib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: at least 1, got {getattr(args, name)}")
    if args.pause_s < 0 or args.warmup < 0:
        p.error("--pause-s and --warmup: at least 0")
    args.stacks = [s for s in args.stacks.split(",") if s]
    if not args.stacks or set(args.stacks) - {table.VLLM, table.OURS}:
        p.error(f"--stacks: of {table.VLLM}, {table.OURS}; got {args.stacks}")
    return args


def run_topology(args):
    """``--topology`` with room for ``--turns`` images a request and ours' recent-items budget at ``--held-kib``."""
    from backend.deploy.topology import load

    topology = load(args.topology)
    if not topology.reuse:
        raise SystemExit(f"{args.topology} has no reuse: block: no sessions to measure (docs/reuse.md)")
    if args.orchestrator == "colocated":
        split = "E+PD" if args.deployment == "epd" else "E/P/D"
        topology = topology.with_orchestrator("colocated", split)
        if split == "E/P/D":
            topology = topology.with_decode_in_process()
    return replace(topology, limits={**topology.limits, "max_images": max(args.turns, topology.limits["max_images"])},
                   reuse={**topology.reuse, "held_bytes": args.held_kib * 1024})


async def converse(client, model: str, stack: str, args, counter) -> dict:
    """Warm-up, then every conversation turn by turn with the pauses (module docstring); ``counter``: an async
    callable giving ours' encoder counters (None for vLLM's server)."""
    for i in range(args.warmup):
        await ask(client, model, warm_messages(args.screenshot, i), args.max_tokens)  # tools: their first import
    session = f"agent-loop-{stack}-{time.time_ns()}"
    conversations = [Conversation(i, args.screenshot, f"{session}-{i}") for i in range(args.conversations)]
    background = Background(args.background_concurrency, args.screenshot, args.background_words)
    records, counts, pauses = [], {}, []
    last = await counter()
    for k in range(1, args.turns + 1):
        requests = [(c, c.messages(k)) for c in conversations]  # drawn before the clock starts
        answers = await asyncio.gather(*(ask(client, model, messages, args.max_tokens, c.session)
                                         for c, messages in requests))
        records += [table.record(stack, k, c.index, a) for (c, _), a in zip(requests, answers)]
        now = await counter()
        if now is not None:
            counts[k] = {"encoded": round(now[COUNTERS[0]] - last[COUNTERS[0]]),
                         "encoder_cache_hits": round(now[COUNTERS[1]] - last[COUNTERS[1]])}
        progress(stack, k, records)
        last = now
        if k < args.turns and args.pause_s > 0:
            pauses.append(await background.run(client, model, args.pause_s))
            last = await counter()  # the background's encodes are no turn's
    return {"records": records, "counts": counts, "pauses": pauses}


def progress(stack: str, turn: int, records: list[dict]) -> None:
    mine = [r for r in records if r["stack"] == stack and r["turn"] == turn]
    print(f"{stack} turn {turn}: TTFT ms {[r['ttft_ms'] for r in mine]}, media {[r['epd_media'] for r in mine]}, "
          f"cached {[r['cached_tokens'] for r in mine]}, errors {[r['error'] for r in mine if r['error']]}",
          file=sys.stderr, flush=True)


def drive(base_url: str, model: str, stack: str, args, metrics_url: str | None = None) -> dict:
    """``converse`` through a fresh ``AsyncOpenAI`` client."""
    from openai import AsyncOpenAI

    from clients.bench.reuse_parts import settled

    async def counter():
        return await settled(metrics_url, COUNTERS) if metrics_url else None

    async def run():
        client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            return await converse(client, model, stack, args, counter)
        finally:
            await client.close()

    return asyncio.run(run())


def run_vllm(args, topology) -> dict:
    """vLLM's own server of the checkpoint with ``llm``'s engine settings, driven, stopped."""
    from backend.deploy.ports import free_ports

    port = free_ports(1)[0]
    argv = stacks.api_server_argv(topology.checkpoint.resolve(), port,
                                  stacks.engine_settings(topology, "baseline", "llm"), *VLLM_FLAGS)
    with stacks.running([stacks.Server("vllm serve", argv, port)], args.logs / table.VLLM, args.start_timeout):
        return {**drive(f"http://127.0.0.1:{port}", stacks.SERVED_NAME, table.VLLM, args), "command": argv}


def run_ours(args, topology) -> dict:
    """tritonserver with its endpoint in the served model's process (``--endpoint in-process``: tools parsed with the
    served checkpoint's tokenizer) or ``frontend.openai`` (given the checkpoint's tokenizer), driven, stopped."""
    flags = ("--tokenizer", str(topology.checkpoint.resolve()))
    with stacks.ours_running(topology, args.deployment, args.logs / table.OURS, in_process=args.endpoint == "in-process",
                             endpoint_flags=flags) as ours:
        return drive(ours.base_url, ours.model, table.OURS, args, ours.metrics_url)


def report(args, topology, runs: dict) -> str:
    """The table (printed and written with everything into ``--out``)."""
    records = [r for run in runs.values() for r in run.get("records", [])]
    counts = {stack: run.get("counts", {}) for stack, run in runs.items()}
    rows = table.turns(records, counts)
    met = table.targets(rows, min(table.TARGET_TURN, args.turns))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    loads = {stack: run.get("load_average") for stack, run in runs.items()}
    width, height = args.screenshot
    head = (f"{args.conversations} conversations x {args.turns} turns, one new {width}x{height} PNG screenshot and a "
            f"tool result a turn, {args.pause_s:g} s tool pauses with {args.background_concurrency} background "
            f"clients; ours: {args.deployment} on {args.topology.name} (held {args.held_kib} KiB; orchestrator "
            f"{args.orchestrator}, endpoint {args.endpoint}); "
            f"{args.max_tokens} greedy tokens; load average before/after each stack: {loads}")
    text = head + "\n\n" + table.markdown(rows, met) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(
        {"settings": settings, "engine_args": topology.engine_args, "limits": topology.limits, "reuse": topology.reuse,
         "turns": rows, "targets": met, "runs": runs}, indent=1, default=str))
    return text


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    topology = run_topology(args)
    runs: dict[str, dict] = {}
    for stack in args.stacks:
        before, started = os.getloadavg(), time.monotonic()
        try:
            runs[stack] = (run_vllm if stack == table.VLLM else run_ours)(args, topology)
        except Exception as exc:  # noqa: BLE001  one stack failing still reports the other
            print(f"{stack}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            runs[stack] = {"failed": f"{type(exc).__name__}: {exc}"}
        runs[stack]["load_average"] = [round(v, 2) for v in (*before, *os.getloadavg())]
        runs[stack]["wall_s"] = round(time.monotonic() - started, 1)
    print(report(args, topology, runs))
    return runs


if __name__ == "__main__":
    main()

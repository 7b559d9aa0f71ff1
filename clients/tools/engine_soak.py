"""Soak one in-process vLLM engine without Triton: the memory of its EngineCore round after round.

    python -m clients.tools.engine_soak --input embeds --requests 1000 --rounds 3

Requests like ``clients.tools.soak``'s (text-only or 1-4 images, 8-24 greedy tokens, a fraction aborted after
the first chunk), given to ``backend.engine.host.EngineHost`` as the ``pd`` model gives them (``--input
embeds``: random ``image_embeds`` + ``image_grid_thw``, ``enable_mm_embeds``) or as ``llm`` does
(``--input images``: decoded images). Prints the EngineCore's RSS before and after each round.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def engine_rss_mib() -> dict[int, float]:
    import psutil

    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if "EngineCore" in " ".join(proc.cmdline()) or "EngineCore" in proc.name():
                out[proc.pid] = proc.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


def make_request(rng: random.Random, seed: int, mode: str, hidden: int):
    import torch
    from PIL import Image

    from backend.request.generate import GenerateRequest

    from clients.tools.soak import request_mix

    sizes, max_tokens = request_mix(rng)
    count = len(sizes)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>" * count + f"Request {seed}: describe."
    sampling = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    if not count or mode == "text":
        return GenerateRequest(prompt=f"Request {seed}: describe.", conversation=None, items=(), sampling=sampling)
    if mode == "images":
        images = tuple(Image.new("RGB", size, color=(seed % 255, 7 * i % 255, 99)) for i, size in enumerate(sizes))
        return GenerateRequest(prompt=prompt, conversation=None, items=images, sampling=sampling)
    grids = []
    for w, h in sizes:  # the tiny checkpoint's processor: sides to multiples of 28 within 28^2..112^2 pixels
        scale = min(1.0, (112 * 112 / (w * h)) ** 0.5)
        gw, gh = max(2, round(w * scale / 28) * 2), max(2, round(h * scale / 28) * 2)
        grids.append([1, gh, gw])
    tokens = sum(t * h * w // 4 for t, h, w in grids)
    embeds = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    return GenerateRequest(prompt=prompt, conversation=None, items=(), sampling=sampling,
                           media_embeds={"image": (embeds, torch.tensor(grids, dtype=torch.int64))})


async def one(host, request, request_id: str, cancel: bool) -> str:
    async with contextlib.aclosing(host.generate(request, request_id)) as deltas:
        async for delta in deltas:
            if cancel:
                await host.abort(request_id)
                return "cancelled"
            if delta.finished:
                return "ok"
    return "ended"


async def drive(host, requests, concurrency: int, cancel_fraction: float, rng: random.Random, tag: str):
    queue = list(enumerate(requests))
    outcomes: dict[str, int] = {}

    async def worker():
        while queue:
            index, request = queue.pop()
            cancel = rng.random() < cancel_fraction
            outcome = await one(host, request, f"{tag}-{index}", cancel)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", choices=("embeds", "images", "text"), default="embeds")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cancel-fraction", type=float, default=0.1)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--engine-arg", action="append", default=[], help="key=json value, over model.json")
    args = parser.parse_args(argv)

    import json

    from backend.engine.host import EngineHost, load_engine_args, metadata_only_engine_args

    engine_args = load_engine_args(ROOT / "model_repository" / ("pd" if args.input == "embeds" else "llm") / "model.json")
    if args.input == "embeds":  # as the pd model starts its engine
        engine_args = metadata_only_engine_args(engine_args)
    for item in args.engine_arg:
        key, value = item.split("=", 1)
        engine_args[key] = json.loads(value)
    host = EngineHost.start(engine_args)
    try:
        from transformers import AutoConfig
        hidden = AutoConfig.from_pretrained(engine_args["model"]).text_config.hidden_size
        rng = random.Random(0)
        host.submit(drive(host, [make_request(rng, 10**6 + i, args.input, hidden) for i in range(32)], 4, 0.0, rng,
                          "warmup")).result()
        time.sleep(args.settle)
        print(f"before: EngineCore RSS {engine_rss_mib()}", flush=True)
        for round_ in range(args.rounds):
            requests = [make_request(rng, round_ * args.requests + i, args.input, hidden) for i in range(args.requests)]
            started = time.perf_counter()
            outcomes = host.submit(drive(host, requests, args.concurrency, args.cancel_fraction, rng,
                                         f"r{round_}")).result()
            seconds = time.perf_counter() - started
            del requests
            time.sleep(args.settle)
            print(f"round {round_ + 1}: {outcomes} in {seconds:.1f} s; EngineCore RSS {engine_rss_mib()}", flush=True)
    finally:
        host.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

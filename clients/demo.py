"""``make demo``: serve ``llm`` (one engine) and ``epd`` (encoder + pd, metadata-only) from the default topology,
ask both about one real image, print each streamed answer with its times, then the verdict: did E+PD give the
baseline's tokens? Exit status 0 only if it did.

The server loads only what the demo asks (``topologies/default.yaml`` rendered for baseline + E+PD into
``.cache/demo/repo``: two vLLM engines, not the default repository's four). The image is a PNG drawn here
(no downloads), written to ``.cache/demo.png`` and sent as a file, as a user of ``clients.chat`` would send one.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from PIL import Image, ImageDraw

from backend.deploy.local_server import Ports, ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.topology import load
from clients import chat
from clients.triton_client import GenerateError, GenerateResult, generate

SERVED = ("baseline", "E+PD")  # llm, and encoder + pd + epd
NOTE = ("[demo] the model is a tiny one with random weights (built locally, no downloads): its answers are noise;\n"
        "       what matters is that E+PD (epd) gives exactly the baseline's (llm) tokens")


def draw_demo_image(path: Path) -> Path:
    image = Image.new("RGB", (112, 84), (40, 90, 200))
    draw = ImageDraw.Draw(image)
    draw.ellipse((10, 10, 50, 50), fill=(230, 40, 40))
    draw.rectangle((60, 30, 100, 75), fill=(250, 220, 40))
    draw.line((0, 80, 112, 60), fill=(255, 255, 255), width=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, "PNG")
    return path


def ask(url: str, model: str, image: Path, question: str, max_tokens: int) -> GenerateResult:
    """One streamed request, as ``clients.chat`` sends it; the answer is printed as it arrives."""
    args = chat.build_parser().parse_args(["--model", model, "--image", str(image), "--max-tokens", str(max_tokens), question])
    result = generate(url, model, chat.make_inputs(args), on_text=lambda t: print(t, end="", flush=True), timeout=300)
    ttft = f"{result.ttft * 1000:.1f} ms" if result.ttft is not None else "n/a"
    print(f"\n    tokens={result.num_output_tokens} TTFT={ttft} total={result.total * 1000:.1f} ms")
    if result.timings:
        print("    stages: " + " ".join(f"{k}={v}" for k, v in result.timings.items() if k != "encoders"))
    return result


def verdict(answers: dict[str, GenerateResult], baseline: str = "llm") -> bool:
    """Print whether every model gave the baseline's answer (same text, same number of tokens)."""
    reference = answers[baseline]
    same = True
    for model, result in answers.items():
        if model == baseline:
            continue
        equal = result.text == reference.text and result.num_output_tokens == reference.num_output_tokens
        same &= equal
        print(f"[demo] {baseline} and {model} gave the same {reference.num_output_tokens} tokens: {'yes' if equal else 'NO'}")
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default="What shapes and colours are in this picture?")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    image = draw_demo_image(ROOT / ".cache" / "demo.png")
    repo = ROOT / ".cache" / "demo" / "repo"
    render(load(ROOT / "topologies" / "default.yaml").only(SERVED), repo)
    log = ROOT / ".cache" / "demo" / "server.log"
    print(f"[demo] starting tritonserver with llm, encoder, pd, epd (log: {log}) ...", flush=True)
    started = time.monotonic()
    answers: dict[str, GenerateResult] = {}
    # free ports: the demo's own server must not collide with a `make serve` already running
    with TritonServer(repo, ports=Ports.free(), log_path=log) as server:
        print(f"[demo] server ready in {server.ready_seconds:.1f} s; gRPC {server.grpc_url}", flush=True)
        print(NOTE)
        for model in ("llm", "epd"):
            print(f"\n[demo] {model} <- {image.name} + {args.question!r}\n    ", end="", flush=True)
            try:
                answers[model] = ask(server.grpc_url, model, image, args.question, args.max_tokens)
            except GenerateError as exc:
                print(f"\n[demo] {model} failed: {exc}", file=sys.stderr)
    print(f"\n[demo] server stopped; demo took {time.monotonic() - started:.1f} s")
    if len(answers) < 2:
        print("[demo] nothing to compare: a model failed (see above and the server log)")
        return 1
    return 0 if verdict(answers) else 1


if __name__ == "__main__":
    sys.exit(main())

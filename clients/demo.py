"""``make demo``: start tritonserver, ask ``llm`` (one engine) and ``epd`` (encoder + pd, metadata-only)
about one real image, print each streamed answer with time to first token and total time, stop the server.

The image is a PNG drawn here (no downloads): a few coloured shapes, written to ``.cache/demo.png``
and sent as a file, exactly as a user of ``clients.chat`` would send one.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from PIL import Image, ImageDraw

from clients import chat
from clients.local_server import ROOT, Ports, TritonServer


def draw_demo_image(path: Path) -> Path:
    image = Image.new("RGB", (112, 84), (40, 90, 200))
    draw = ImageDraw.Draw(image)
    draw.ellipse((10, 10, 50, 50), fill=(230, 40, 40))
    draw.rectangle((60, 30, 100, 75), fill=(250, 220, 40))
    draw.line((0, 80, 112, 60), fill=(255, 255, 255), width=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, "PNG")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="model to ask (repeatable; default: llm and epd)")
    parser.add_argument("--question", default="What shapes and colours are in this picture?")
    args = parser.parse_args(argv)
    image = draw_demo_image(ROOT / ".cache" / "demo.png")
    ports = Ports.free()  # the demo's own server must not collide with a `make serve` already running
    log = ROOT / ".cache" / "demo-server.log"
    print(f"[demo] starting tritonserver (log: {log}) ...", flush=True)
    started = time.monotonic()
    with TritonServer(ports=ports, log_path=log) as server:
        print(f"[demo] server ready in {server.ready_seconds:.1f} s; gRPC {server.grpc_url}", flush=True)
        code = 0
        for model in args.model or ["llm", "epd"]:
            print(f"\n[demo] {model} <- {image.name} + {args.question!r}", flush=True)
            code |= chat.main(["--url", server.grpc_url, "--model", model, "--image", str(image), args.question])
    print(f"[demo] server stopped; demo took {time.monotonic() - started:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())

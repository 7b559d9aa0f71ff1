"""Ask a generating model (``llm``, ``epd``, ...) a question about images (or audio); print tokens as they arrive.

    python -m clients.chat --image cat.png "What is in the image?"
    python -m clients.chat --protocol http --model llm --max-tokens 32 --image a.png --image b.jpg "Compare them."
    python -m clients.chat --model epd --audio clip.wav "What is this sound?"   # an audio checkpoint's server

Prints the streamed answer, then time to first token and total time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from backend.protocol.generate import GenerateInputs

from clients.triton_client import GenerateError, generate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m clients.chat", description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="the question (text)")
    parser.add_argument("--image", action="append", type=Path, default=[], help="an image file; repeat for several")
    parser.add_argument("--audio", action="append", type=Path, default=[],
                        help="an audio file (WAV, FLAC, OGG, ...; a server of an audio checkpoint); repeat for several")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 for gRPC, :8000 for HTTP)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--raw-prompt", action="store_true",
                        help="send the prompt as text_input as is, instead of a chat message")
    parser.add_argument("--timeout", type=float, default=300.0)
    return parser


def make_inputs(args: argparse.Namespace) -> GenerateInputs:
    images, audios = [path.read_bytes() for path in args.image], [path.read_bytes() for path in args.audio]
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.raw_prompt:
        return GenerateInputs(prompt=args.prompt, images=images, audios=audios, sampling=sampling)
    content = [{"type": "image"} for _ in images] + [{"type": "audio"} for _ in audios] + \
        [{"type": "text", "text": args.prompt}]
    return GenerateInputs(messages=[{"role": "user", "content": content}], images=images, audios=audios,
                          sampling=sampling)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    try:
        result = generate(url, args.model, make_inputs(args), protocol=args.protocol,
                          on_text=lambda t: print(t, end="", flush=True), timeout=args.timeout)
    except GenerateError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    ttft = f"{result.ttft * 1000:.1f} ms" if result.ttft is not None else "n/a"
    print(f"\n--\nfinish_reason={result.finish_reason} input_tokens={result.num_input_tokens} "
          f"output_tokens={result.num_output_tokens} TTFT={ttft} total={result.total * 1000:.1f} ms")
    if result.timings:
        print("stages: " + " ".join(f"{k}={v}" for k, v in result.timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

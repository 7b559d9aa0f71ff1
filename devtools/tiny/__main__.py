"""``python -m devtools.tiny``: build a tiny random-weight checkpoint of a family (``--family``: ``qwen2_vl``, the
default, in ``devtools.tiny.model``; ``qwen2_5_vl`` and ``qwen3_vl`` in ``devtools.tiny.families``; ``qwen2_5_omni`` in ``devtools.tiny.omni``), or one shaped
like a real checkpoint (``--like DIR``, ``devtools.tiny.model.build_like``). scripts/setup.sh builds the tests'
models so."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from devtools.tiny.families import DEFAULT_OUT, build_family
from devtools.tiny.model import build_like


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight checkpoint (devtools.tiny).")
    parser.add_argument("--out", type=Path, help="the checkpoint folder (default: models/tiny-<family>)")
    parser.add_argument("--family", default="qwen2_vl", choices=tuple(DEFAULT_OUT),
                        help="the model family of the tiny checkpoint (not with --like)")
    parser.add_argument("--like", type=Path, help="a folder with a real checkpoint's config.json (and processor, "
                                                  "generation config, chat template): build one shaped like it")
    parser.add_argument("--layers", type=int, default=2, help="--like: language-model layers")
    parser.add_argument("--vision-layers", type=int, default=2, help="--like: vision tower blocks")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    args.out = args.out or Path(DEFAULT_OUT[args.family] if not args.like else "models/tiny-qwen2-vl")
    if args.like:
        built = build_like(args.like, args.out, args.layers, args.vision_layers, force=args.force)
    else:
        built = build_family(args.family, args.out, force=args.force)
    print(f"{'built' if built else 'up to date'}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

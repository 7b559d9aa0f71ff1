"""``python -m frontend.openai``: the OpenAI-compatible endpoint on 127.0.0.1:$OPENAI_PORT (default 9000) in front
of tritonserver's gRPC endpoint (127.0.0.1:$GRPC_PORT)."""
from __future__ import annotations

import argparse
import gc
import os

DEFAULT_MODELS = "llm,epd,epd_disagg"


def _die_with_parent() -> None:
    """Exit when the process that started this one does (``backend.deploy.local_server`` execs tritonserver after
    starting this endpoint: the endpoint then ends with the server)."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", "9000")))
    parser.add_argument("--grpc-url", default=f"127.0.0.1:{os.environ.get('GRPC_PORT', '8001')}",
                        help="tritonserver's gRPC endpoint")
    parser.add_argument("--models", default=DEFAULT_MODELS, help="the generating models served (`model` values)")
    parser.add_argument("--tokenizer", help="the served checkpoint's folder: its tokenizer for tool calls (none: tools "
                        "are refused)")
    parser.add_argument("--tool-parser", help="vLLM's tool parser (default: the checkpoint family's, e.g. hermes)")
    parser.add_argument("--max-n", type=int, default=8, help="the most choices a request may ask for (n)")
    parser.add_argument("--shed-window-ms", type=float, default=50.0,
                        help="after a model refuses a request for load (429), refuse its requests of that priority "
                             "or lower here for this long (frontend.openai.shedding; 0: off)")
    parser.add_argument("--with-parent", action="store_true", help="exit when the parent process exits")
    parser.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                        help="uvicorn's event loop (auto: uvloop where installed)")
    args = parser.parse_args(argv)
    if args.with_parent:
        _die_with_parent()
    import uvicorn

    from frontend.openai.app import create_app
    from frontend.openai.shedding import Shedding
    from frontend.openai.tools import ToolSupport

    from frontend.openai import translate

    translate.MAX_N = args.max_n
    tools = ToolSupport(args.tokenizer, args.tool_parser) if args.tokenizer else None
    shedding = Shedding(args.shed_window_ms / 1000)
    app = create_app(args.grpc_url, [m for m in args.models.split(",") if m], tools, shedding)
    if os.environ.get("EPD_GC_FREEZE", "1") != "0":  # what start-up made, out of the collector's walks, as the stubs do
        gc.collect(1)                                # (backend.triton.counter_batch.freeze_the_loaded_heap)
        gc.freeze()
    uvicorn.run(app, host=args.host, port=args.port, loop=args.loop, log_level="warning")


if __name__ == "__main__":
    main()

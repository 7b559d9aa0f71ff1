"""Does this tritonserver survive clients that cancel decoupled streams? No project code involved.

A throwaway repository with one decoupled Python model that streams up to 2000 tiny responses per request as
fast as it can (checking ``is_cancelled`` every 16). ``--concurrency`` clients each send a request, cancel it
after a random 1-60 responses, and start over, for ``--seconds``. ``--via grpc`` cancels the gRPC stream;
``--via http`` reads ``generate_stream`` and closes the connection. A request with no response for 20 s counts
as hung (the clients then stop). Prints cancels, hung requests, whether the server died, and its stop time.

Triton 2.51, 2 cores (2026-12-01): over gRPC, requests hung (1 run) or the server died (9 runs) within 60 s;
over HTTP, 9,000-27,000 cancels, no hang, no crash (docs/results/robustness.md, "gRPC stream cancellation").

    python -m clients.tools.triton_cancel_check --via grpc --seconds 60
"""
from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

CONFIG = """name: "spam"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

MODEL = '''import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            threading.Thread(target=self.run, args=(request.get_response_sender(), n), daemon=True).start()

    def run(self, sender, n):
        try:
            for i in range(n):
                if i % 16 == 0 and sender.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))]))
        finally:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

HUNG_SECONDS = 20.0


async def _grpc_once(url: str, stop_after: int) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(url)
    count = grpcclient.InferInput("N", [1], "INT32")
    count.set_data_from_numpy(np.array([2000], dtype=np.int32))

    async def requests():
        yield {"model_name": "spam", "inputs": [count]}

    call = client.stream_infer(requests())
    try:
        seen = 0
        async for _result, _error in call:
            seen += 1
            if seen >= stop_after:
                call.cancel()
                return
    finally:
        await client.close()


async def _http_once(session, url: str, stop_after: int) -> None:
    async with session.post(f"http://{url}/v2/models/spam/generate_stream", json={"N": 2000}) as resp:
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data:"):
                seen += 1
                if seen >= stop_after:
                    resp.close()
                    return


async def drive(url: str, via: str, seconds: float, concurrency: int, seed: int = 0) -> dict:
    import aiohttp

    rng, stats, end = random.Random(seed), {"cancels": 0, "hung": 0, "errors": 0}, time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:
        async def worker():
            while time.monotonic() < end and not stats["hung"]:
                once = _grpc_once(url, rng.randint(1, 60)) if via == "grpc" else _http_once(session, url, rng.randint(1, 60))
                try:
                    async with asyncio.timeout(HUNG_SECONDS):
                        await once
                    stats["cancels"] += 1
                except TimeoutError:
                    stats["hung"] += 1
                except Exception:  # noqa: BLE001 - the server went away (a crash): counted, the run goes on
                    stats["errors"] += 1
                    await asyncio.sleep(0.5)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--via", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)

    from backend.deploy.local_server import TritonServer

    with tempfile.TemporaryDirectory(prefix="cancel-check-") as tmp:
        repo = Path(tmp) / "repo"
        (repo / "spam" / "1").mkdir(parents=True)
        (repo / "spam" / "config.pbtxt").write_text(CONFIG)
        (repo / "spam" / "1" / "model.py").write_text(MODEL)
        server = TritonServer(repo, log_path=Path(tmp) / "server.log")
        with server:
            url = server.grpc_url if args.via == "grpc" else server.http_url
            stats = asyncio.run(drive(url, args.via, args.seconds, args.concurrency))
            died = server.proc.poll()
            crash = [line for line in (Path(tmp) / "server.log").read_text(errors="replace").splitlines() if "Signal (" in line]
    print(f"via {args.via}, {args.concurrency} clients, {args.seconds:.0f} s: {stats['cancels']} cancels, "
          f"{stats['hung']} hung, {stats['errors']} failed; server {'exited ' + str(died) if died is not None else 'alive'}"
          f"{' (' + crash[0].strip() + ')' if crash else ''}; stop took "
          f"{'-' if server.stop_seconds is None else f'{server.stop_seconds:.1f} s'}")
    return 0 if not (stats["hung"] or stats["errors"] or died is not None) else 1


if __name__ == "__main__":
    raise SystemExit(main())

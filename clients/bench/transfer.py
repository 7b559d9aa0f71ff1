"""Embedding handoff between two processes, three ways, side by side in one run:

(a) the project's path, ``EmbeddingConsumer.pull``: a producer process publishes leases in its
    NIXL-registered pool; this process pulls each one, through both of its data paths:
    (a1) same-host copy out of the producer's pool memfd + NIXL release notification (chosen on one host),
    (a2) one NIXL READ carrying the release notification (chosen across hosts; forced here).
    Timed: the pull, leases published beforehand, pulled back to back.
(b) Triton tensor through BLS: a ``bench_producer`` Python model returns the tensor as an output; a
    ``bench_consumer`` model fetches it with BLS ``exec()`` and times each call (both in a real
    tritonserver, each a stub process).
(c) memcpy in one process (``torch`` copy): the floor.

Also the idle CPU of NIXL agents after transfers (producer process and this process, 3 s idle).

    python -m clients.bench.transfer [--sizes 65536,1048576,16777216] [--iters 200]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import torch

from backend.transfer.consumer import EmbeddingConsumer
from devtools.diagnostics.pool_process import ProducerProcess, make_layout

PRODUCER_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "nbytes").as_numpy()[0])
            if getattr(self, "buf", None) is None or self.buf.size != n // 4:
                self.buf = np.random.default_rng(0).standard_normal(n // 4).astype(np.float32)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("embeddings", self.buf)]))
        return out
'''
CONSUMER_MODEL = '''
import time, numpy as np
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            n = pb_utils.get_input_tensor_by_name(r, "nbytes")
            iters = int(pb_utils.get_input_tensor_by_name(r, "iters").as_numpy()[0])
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                resp = pb_utils.InferenceRequest(model_name="bench_producer", inputs=[n],
                                                 requested_output_names=["embeddings"]).exec()
                arr = pb_utils.get_output_tensor_by_name(resp, "embeddings").as_numpy()
                assert arr.nbytes == int(n.as_numpy()[0])
                times.append(time.perf_counter() - t)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("seconds", np.array(times, np.float64))]))
        return out
'''
CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {inputs} ]
output [ {{ name: "{out}" data_type: {out_type} dims: [ -1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
'''


def _repository(root: Path) -> Path:
    specs = {
        "bench_producer": (PRODUCER_MODEL, '{ name: "nbytes" data_type: TYPE_INT64 dims: [ 1 ] }', "embeddings", "TYPE_FP32"),
        "bench_consumer": (CONSUMER_MODEL, '{ name: "nbytes" data_type: TYPE_INT64 dims: [ 1 ] }, '
                                           '{ name: "iters" data_type: TYPE_INT64 dims: [ 1 ] }', "seconds", "TYPE_FP64"),
    }
    for name, (code, inputs, out, out_type) in specs.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(textwrap.dedent(code))
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, inputs=inputs, out=out, out_type=out_type))
    return root


def _summary(seconds: list[float], nbytes: int) -> dict:
    med = statistics.median(seconds)
    return {"p50_us": med * 1e6, "p90_us": sorted(seconds)[int(len(seconds) * 0.9)] * 1e6, "GBps": nbytes / med / 1e9}


def bench_nixl(sizes: list[int], iters: int, same_host_copy: bool = True) -> tuple[dict, dict]:
    results = {}
    consumer = EmbeddingConsumer(role="bench-consumer", same_host_copy=same_host_copy)
    with ProducerProcess(pool_bytes=(256 << 20) + 4 * max(sizes), lease_seconds=600) as producer:
        for nbytes in sizes:
            tensor = torch.randn(nbytes // 4 // 128, 128)
            for _ in range(3):  # warm-up: connection set-up, first registration
                consumer.pull(make_layout(producer.call("publish", tensor), tensor))
            # all leases published first, then pulled back to back (as the BLS loop below fetches)
            layouts = [make_layout(doc, tensor) for doc in
                       producer.call("publish_many", tensor, max(4, min(iters, (256 << 20) // nbytes)))]
            seconds = []
            for layout in layouts:
                t = time.perf_counter()
                pulled = consumer.pull(layout)
                seconds.append(time.perf_counter() - t)
            assert torch.equal(pulled, tensor)
            results[nbytes] = _summary(seconds, nbytes)
        cpu_before, mine_before = producer.call("cpu"), sum(os.times()[:2])
        time.sleep(3.0)
        idle = {"producer_core_pct": (producer.call("cpu") - cpu_before) / 3.0 * 100,
                "consumer_core_pct": (sum(os.times()[:2]) - mine_before) / 3.0 * 100}
    return results, idle


def bench_triton(sizes: list[int], iters: int) -> dict:
    import tritonclient.http as httpclient

    from backend.deploy.local_server import TritonServer

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        with TritonServer(_repository(Path(tmp) / "repo"), log_path=Path(tmp) / "server.log") as server:
            client = httpclient.InferenceServerClient(server.http_url)  # closed before the stop (else 30 s)
            for nbytes in sizes:
                n = max(4, min(iters, (256 << 20) // nbytes))
                inputs = []
                for name, value in (("nbytes", nbytes), ("iters", n + 3)):
                    tensor = httpclient.InferInput(name, [1], "INT64")
                    tensor.set_data_from_numpy(np.array([value], dtype=np.int64))
                    inputs.append(tensor)
                seconds = client.infer("bench_consumer", inputs).as_numpy("seconds").tolist()[3:]
                results[nbytes] = _summary(seconds, nbytes)
            client.close()
    return results


def bench_memcpy(sizes: list[int], iters: int) -> dict:
    results = {}
    for nbytes in sizes:
        src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        seconds = []
        for _ in range(max(4, min(iters, (256 << 20) // nbytes))):
            t = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t)
        results[nbytes] = _summary(seconds, nbytes)
    return results


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Embedding handoff benchmark: NIXL vs Triton tensor (BLS) vs memcpy")
    parser.add_argument("--sizes", default="65536,1048576,16777216")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    same_host, idle = bench_nixl(sizes, args.iters, same_host_copy=True)
    nixl, _ = bench_nixl(sizes, args.iters, same_host_copy=False)
    triton = bench_triton(sizes, args.iters)
    memcpy = bench_memcpy(sizes, args.iters)
    print("GB/s (median), and per-item latency p50 / p90 in µs; ratios against the Triton tensor path\n")
    print("| size | (a1) same-host copy | (a2) NIXL READ | (b) Triton tensor via BLS | (a1)/(b) | (a2)/(b) | (c) memcpy |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        a1, a2, b, c = same_host[n], nixl[n], triton[n], memcpy[n]
        cell = lambda r: f"{r['GBps']:.2f} ({r['p50_us']:.0f} / {r['p90_us']:.0f})"
        print(f"| {_size(n)} | {cell(a1)} | {cell(a2)} | {cell(b)} | {a1['GBps'] / b['GBps']:.1f}x | "
              f"{a2['GBps'] / b['GBps']:.1f}x | {c['GBps']:.2f} ({c['p50_us']:.1f}) |")
    print(f"\nidle NIXL agents over 3 s after the transfers: producer process {idle['producer_core_pct']:.2f}% of a core, "
          f"consumer process {idle['consumer_core_pct']:.2f}% of a core")
    results = {"same_host_copy": same_host, "nixl_read": nixl, "triton_bls": triton, "memcpy": memcpy, "idle": idle}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()

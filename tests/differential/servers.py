"""The CLI's servers: a family's topology rendered into a temporary model repository and served by its own
tritonserver on 127.0.0.1 with free ports (``backend.deploy.local_server.TritonServer``, always stopped), and the OpenAI
endpoint in front of it (``tests.e2e.conftest.openai_endpoint``)."""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from backend.deploy.local_server import ROOT, TritonServer
from tests.differential.families import Family
from tests.differential.runner import Target


@contextlib.contextmanager
def served(fam: Family, routes: tuple[str, ...], log_dir: Path | None = None):
    """A ``Target`` on a fresh server of ``fam``'s topology (and its OpenAI endpoint when ``routes`` has openai);
    everything started here is stopped on the way out, a failure or Ctrl-C included. The server's log stays in
    ``log_dir`` (default: a temporary directory, named in what is printed)."""
    from backend.deploy.render import render
    from backend.deploy.topology import load
    from devtools.tiny.families import DEFAULT_OUT, build_family
    from tests.e2e.conftest import openai_endpoint

    if fam.name in DEFAULT_OUT:
        build_family(fam.name, ROOT / DEFAULT_OUT[fam.name])  # the tiny checkpoint, if missing
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"differential-{fam.name}-"))
    repo = log_dir / "repository"
    render(load(ROOT / "topologies" / fam.topology, "cpu"), repo)
    log = log_dir / "server.log"
    print(f"[differential] starting tritonserver for {fam.name} ({fam.topology}); log {log}", flush=True)
    with TritonServer(repo, log_path=log) as server:
        print(f"[differential] ready in {server.ready_seconds:.0f} s on {server.grpc_url}", flush=True)
        if "openai" not in routes:
            yield Target(server.grpc_url), server
            return
        with openai_endpoint(server.grpc_url) as base:
            yield Target(server.grpc_url, base), server


def encoder_batching(server) -> str:
    """How Triton batched the encoder's items so far: items, executions and items per execution (Triton's
    ``nv_inference_count`` / ``nv_inference_exec_count``), and how many the encoders computed rather than took
    from their caches (``epd_encoder_items_total``)."""
    from tests.e2e.conftest import metric, metrics

    counts = metrics(server, ("nv_inference_count", "nv_inference_exec_count"), model="encoder")
    items, runs = counts["nv_inference_count"], counts["nv_inference_exec_count"]
    encoded = metric(server, "epd_encoder_items_total", model="encoder")
    return (f"encoder: {items:.0f} items in {runs:.0f} executions ({items / max(runs, 1):.2f} a batch), "
            f"{encoded:.0f} encoded, the rest from its cache")

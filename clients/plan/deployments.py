"""The deployments ``clients.plan.validate`` measures, each started fresh and handed out as a ``Served``: a closed loop
of requests against it, and the processes whose CPU is its own (the rest of the machine's busy time is background).
``clients.plan.measure`` profiles ``single`` (or a running server, as a ``Served`` of its own).

``single``: one tritonserver serving E+PD (``--topology``, with ``clients.bench.served``'s checkpoint, machine,
engines and image preprocessing laid over it, as the side-by-side benchmark does; the client: gRPC streaming,
``clients.bench.load``).
``hosts``: ``topologies/hosts-e-pd.yaml`` with ``--pd-replicas`` pd hosts, every host a network namespace of this
machine with its own tritonserver (``tests.hosts_deploy``, as ``clients.bench.replicas`` starts it; the client: HTTP
from threads in a host of its own; embeddings over NIXL/UCX TCP). Needs root.
"""
from __future__ import annotations

import asyncio
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clients.bench import served as bench_served
from clients.bench.load import run_concurrency
from clients.bench.replicas import check, closed_loop


def served_topology(args):
    """``--topology``'s E+PD deployment as ``single`` serves it (``clients.bench.served.served_arguments``)."""
    return bench_served.served_topology(args, "E+PD")


class Quiet:
    def update(self, n: int) -> None:
        pass


def grpc_run(url: str) -> Callable:
    """``Served.run`` for a server's gRPC address (streaming, ``clients.bench.load``)."""
    def run(requests, concurrency):
        results, wall = asyncio.run(run_concurrency(url, "epd", concurrency, requests, Quiet()))
        return results.samples, results.errors, wall
    return run


@dataclass
class Served:
    """A running deployment: ``run(requests, concurrency) -> (samples, errors, wall seconds)``, ``pids()`` its
    processes now, ``replicas`` its pd engines, ``metrics`` its server's metrics URL, ``engine_args`` the vLLM
    engine arguments it serves with, ``encoder_instances`` its encoder's, ``device`` its pd engine's and
    ``checkpoint`` its model's (``single``; else not known)."""

    name: str
    run: Callable
    pids: Callable[[], list[int]]
    replicas: int = 1
    metrics: str = ""
    engine_args: dict = field(default_factory=dict)
    encoder_instances: int = 1
    device: str = "cpu"  # where its pd engine runs
    checkpoint: Path | None = None


@contextmanager
def single(args):
    from backend.deploy.local_server import Ports, TritonServer, group_members
    from backend.deploy.ports import free_ports
    from backend.deploy.render import render

    topology = served_topology(args)
    with tempfile.TemporaryDirectory(prefix="plan-validate-") as repo:
        render(topology, Path(repo))
        with TritonServer(Path(repo), ports=Ports(*free_ports(3)), log_path=Path(repo) / "tritonserver.log") as server:
            yield Served("single", grpc_run(server.grpc_url), lambda: group_members(server.proc.pid),
                         metrics=server.metrics_url, engine_args=topology.engine_args,
                         encoder_instances=topology.stages["encoder"].instances,
                         device=topology.stages["pd"].device, checkpoint=topology.checkpoint)


@contextmanager
def hosts(args):
    from tests.hosts_deploy import CLIENT, HostsDeployment, hosts_e_pd
    from tests.netns import Network

    with tempfile.TemporaryDirectory(prefix="plan-validate-hosts-") as tmp:
        topology = hosts_e_pd(Path(tmp), args.pd_replicas)
        with Network(HostsDeployment.addresses(topology)) as net, \
                HostsDeployment(topology, net, Path(tmp) / "hosts") as deployed:
            def run(requests, concurrency):
                outcomes, wall = closed_loop(lambda inputs: deployed.submit("epd", inputs), requests, concurrency)
                samples, errors = check(outcomes, None)
                return samples, errors, wall

            def pids():
                return sorted({pid for host in HostsDeployment.addresses(topology) if host != CLIENT
                               for pid in net.pids(host)})
            yield Served("hosts", run, pids, args.pd_replicas)


DEPLOYMENTS = {"single": single, "hosts": hosts}

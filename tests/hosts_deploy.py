"""A topology's hosts as network namespaces, each running its own tritonserver (``backend.deploy.hosts``'s plans on a
``tests.netns.Network``): what the multi-host e2e tests and the replica benchmark start.

``HostsDeployment(topology, network, workdir)`` writes every host's repository, starts every host's server in its
namespace with the host's launch environment (``UCX_TLS=tcp`` added: hosts on one machine would otherwise move NIXL
READs by cross-memory attach, not over their veths; ``tests.netns``), waits until each is ready, and stops each
(SIGTERM, then what ``backend.deploy.local_server.TritonServer.stop`` checks) on exit. The test process talks to them from a
client host of the network (``CLIENT``) through threads in its namespace (``Network.executor``): HTTP generate
requests, readiness and metrics, as a client on another machine would. No pytest in here.
"""
from __future__ import annotations

import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from backend.deploy.hosts import HostPlan, host_plan
from backend.deploy.local_server import Ports, TritonServer, server_env
from backend.deploy.schema import Topology
from backend.deploy.stacks import report_native_stacks
from backend.deploy.topology import load
from backend.protocol.generate import GenerateInputs
from backend.protocol.settings import RoutingSettings
from clients.triton_client import GenerateError, GenerateResult, generate
from orchestrator.replicas import PROBE_SECONDS
from tests.netns import Network

CLIENT = "client"
CLIENT_ADDRESS = "10.77.0.200"
SETTLE_SECONDS = 2 * RoutingSettings.health_check_seconds + PROBE_SECONDS
ROOT = Path(__file__).resolve().parents[1]


def hosts_e_pd(workdir: Path, pd_replicas: int = 1, reuse: dict | None = None, encoders: int = 1) -> Topology:
    """topologies/hosts-e-pd.yaml with ``pd_replicas`` pd hosts: pd-2, pd-3, ... each a host of its own at
    10.77.0.5, .6, ... (its file's own comment), ``encoders`` encoder hosts (encode-2, ... at 10.77.0.12, ...), and
    ``reuse`` as its reuse block, written to ``workdir`` (its checkpoint made absolute) and loaded."""
    if not 1 <= pd_replicas <= 8:
        raise ValueError(f"pd_replicas: expected 1..8, got {pd_replicas}")
    doc = yaml.safe_load((ROOT / "topologies/hosts-e-pd.yaml").read_text())
    for n in range(2, pd_replicas + 1):
        doc["hosts"][f"pd-{n}"] = {"address": f"10.77.0.{3 + n}", "interface": "eth0", "stages": ["pd"]}
    for n in range(2, encoders + 1):
        doc["hosts"][f"encode-{n}"] = {"address": f"10.77.0.{10 + n}", "interface": "eth0", "stages": ["encoder"]}
    if reuse is not None:
        doc["reuse"] = reuse
    doc["checkpoint"] = str((ROOT / "topologies" / doc["checkpoint"]).resolve())
    path = Path(workdir) / f"hosts-e-pd-{pd_replicas}-{encoders}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load(path, machine="cpu")


class HostServer(TritonServer):
    """One host's tritonserver, started in its namespace and probed from the client host's threads."""

    def __init__(self, network: Network, plan: HostPlan, log_path: Path, client: ThreadPoolExecutor):
        host = plan.host
        env = server_env({**os.environ, **plan.env, "UCX_TLS": "tcp"})
        super().__init__(plan.repository, Ports(host.http_port, host.grpc_port, host.metrics_port), log_path,
                         env=env, argv=network.command(plan.name, list(plan.argv)))
        self.plan, self.client = plan, client

    @property
    def http_url(self) -> str:
        return f"{self.plan.host.address}:{self.plan.host.http_port}"

    @property
    def grpc_url(self) -> str:
        return self.plan.host.grpc

    @property
    def metrics_url(self) -> str:
        return f"http://{self.plan.host.address}:{self.plan.host.metrics_port}/metrics"

    def is_ready(self) -> bool:
        return self.client.submit(TritonServer.is_ready, self).result()

    def _metrics_up(self) -> bool:
        return self.client.submit(TritonServer._metrics_up, self).result()


class HostsDeployment:
    """``topology``'s hosts served on ``network`` (which has a host per topology host, and ``CLIENT``)."""

    def __init__(self, topology: Topology, network: Network, workdir: Path, start_timeout: float = 400.0):
        self.topology, self.network, self.workdir = topology, network, Path(workdir)
        self.plans = host_plan(topology, self.workdir / "hosts")
        self.client = network.executor(CLIENT, workers=32)
        self._stacks_lock, self._stacks_reported = threading.Lock(), set()
        self.servers: dict[str, HostServer] = {}
        self.start_timeout = start_timeout

    @staticmethod
    def addresses(topology: Topology) -> dict[str, str]:
        """The network's hosts for ``topology``: its hosts' addresses and the client's."""
        return {**{name: spec.address for name, spec in topology.hosts.items()}, CLIENT: CLIENT_ADDRESS}

    def __enter__(self) -> "HostsDeployment":
        try:
            for plan in self.plans.values():
                plan.write()
            with ThreadPoolExecutor(max_workers=len(self.plans)) as starting:  # every host loads at once
                for future in [starting.submit(self.start, name) for name in self.plans]:
                    future.result()
            # an orchestrator whose health checks began while another host was still loading routes around that
            # host until its next check finds it (orchestrator.replicas): give them that check
            time.sleep(SETTLE_SECONDS)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, name: str) -> HostServer:
        """Start host ``name``'s server (again, after ``kill``), and wait until it is ready."""
        server = HostServer(self.network, self.plans[name], self.workdir / f"{name}.log", self.client)
        self.servers[name] = server
        server.start(self.start_timeout)
        return server

    def kill(self, name: str) -> None:
        """The host dies: every process in it killed at once (``Network.kill_host``), and its memory with it: the
        /dev/shm entries its processes held (these hosts share one machine's /dev/shm; a real host's goes down with
        it), which processes killed hard cannot remove (vLLM's semaphores, the stubs' regions)."""
        from tests.e2e.conftest import _mapped_by, _shm_inodes, left_behind

        entries = _shm_inodes()
        held = {entry for pid in self.network.pids(name) for entry in _mapped_by(pid, entries)}
        self.network.kill_host(name)
        self.servers[name].stop()  # reaps, records the stubs' regions the kill left and removes them
        for entry in left_behind(held, settle=0.5):
            Path("/dev/shm", entry).unlink(missing_ok=True)

    def close(self) -> None:
        try:
            for server in self.servers.values():
                server.stop()
        finally:
            self.client.shutdown(wait=True)

    def url(self, stage: str = "epd") -> str:
        """The HTTP address of the (first) host serving ``stage``."""
        name = next(name for name, plan in self.plans.items() if stage in plan.host.stages)
        return self.servers[name].http_url

    def ask(self, model: str, inputs: GenerateInputs, url: str | None = None) -> GenerateResult | GenerateError:
        """One HTTP generate request from the client host; the error the server answered is returned, not raised."""
        return self.submit(model, inputs, url).result()

    def submit(self, model: str, inputs: GenerateInputs, url: str | None = None):
        """``ask`` without waiting: its future. A request the server never finishes (the client's timeout) prints the
        native stacks of the asked host's processes first (the failing test's output shows them), then raises."""
        url = url or self.url()

        def asked():
            try:
                return _ask(url, model, inputs)
            except TimeoutError:
                name = next((n for n, server in self.servers.items() if server.http_url == url), None)
                with self._stacks_lock:  # once per host: requests timing out together would ptrace it at once (EPERM)
                    first = name is not None and name not in self._stacks_reported
                    self._stacks_reported.add(name)
                    if first:
                        report_native_stacks(self.network.pids(name), self.servers[name].log_path)
                raise
        return self.client.submit(asked)

    def metric(self, name: str, metric: str, **labels) -> float:
        """``metric`` on host ``name``'s metrics endpoint, summed over the series carrying ``labels``."""
        text = self.client.submit(_get, self.servers[name].metrics_url).result()
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(metric + "{") and all(w in line for w in want))


def _ask(url: str, model: str, inputs: GenerateInputs):
    try:
        return generate(url, model, inputs, protocol="http", timeout=180)
    except GenerateError as exc:
        return exc


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()

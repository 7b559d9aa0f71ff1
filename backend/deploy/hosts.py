"""One topology, many hosts: a topology's ``hosts:`` block places its stages on hosts, each running a tritonserver of
its own with a model repository of its own; rendering gives each host its repository and its launch command.

    hosts:
      front:    {address: 10.77.0.2, interface: eth0, stages: [epd]}
      encode-1: {address: 10.77.0.3, interface: eth0, stages: [encoder]}
      pd-1:     {address: 10.77.0.4, interface: eth0, stages: [pd]}
      pd-2:     {address: 10.77.0.5, interface: eth0, stages: [pd]}     # a second pd replica

    python -m backend.deploy.topology render topologies/hosts-e-pd.yaml --host encode-1 --out /tmp/encode-1
    python -m backend.deploy.topology hosts topologies/hosts-e-pd.yaml --out /tmp/hosts   # all, with launch commands

A host's name is a DNS label (lower-case letters, digits, ``-``): its identity (``EPD_HOST``) and its repository's
folder. Its keys:
- ``address`` (required): an IP address or DNS name the other hosts reach it at; its server binds its ports to it.
- ``stages`` (required): the topology stages (``stages`` keys) whose models it serves: ``epd`` is the proxy
  orchestrator; a colocated orchestrator comes with its host stage (pd, prefill). A stage on N hosts has N replicas,
  each with the stage's ``instances`` (Triton instances) on the stage's device (``gpus``: that host's GPU ids).
- ``grpc_port`` (8001), ``http_port`` (8000), ``metrics_port`` (8002): no two hosts share an address and port.
- ``interface`` (required): the network device embeddings and KV move on (NIXL over UCX's TCP transport:
  ``UCX_NET_DEVICES``; a comma-separated list, or ``all`` for UCX's default, is passed as given). Required, not
  guessed: UCX's default takes every device, loopback included, and device names differ from host to host (eth0 in a
  pod or a network namespace, ens5 on a VM), so a default would be wrong somewhere without saying so.

The orchestrators' endpoints follow from the block: a generator stage's (pd, prefill, decode) is the list of the
``address:grpc_port`` of the hosts that carry it; the encoder's is ``local`` (BLS in the orchestrator's own server)
only where the orchestrator's host is the only host with the encoder, else that list. So stage ``endpoint`` keys are
refused beside a block (it is the one place that says where the stages are), and so is an embedding tier the
launcher would start (``tier`` without ``master``): each host would start its own, and the launch commands start none.

Each host's launch command (``HostPlan``, ``host_plan``) is tritonserver (``.venv/bin/tritonserver``: the Python
backend's environment) on the host's repository, bound to its address and ports, with ``UCX_NET_DEVICES`` (its
interface), ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (its address: vLLM's NixlConnector side channel for KV) and ``EPD_HOST``
(its name). The checkpoint is named relative to the repository, as in ``render``: render on each host, or keep
the same layout. Without a ``hosts:`` block nothing here applies: one server serves the whole topology; and a plain
``render`` (``backend.deploy.local_server --topology``) of a file with one still gives one server with every stage, all
``local``: the same topology on one machine.
"""
from __future__ import annotations

import ipaddress
import re
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from backend.deploy.render import render_files, write_files
from backend.deploy.schema import ENDPOINT_STAGES, HOSTS, ROOT, Topology, TopologyError, check_keys
from backend.deploy.server_address import LOCAL
from backend.protocol.stages import Stage

HOST_KEYS = {"address", "stages", "interface", "grpc_port", "http_port", "metrics_port"}
PORT_DEFAULTS = {"http_port": 8000, "grpc_port": 8001, "metrics_port": 8002}  # tritonserver's own defaults
TRITONSERVER = ROOT / ".venv" / "bin" / "tritonserver"  # the real binary with the Python backend's environment
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}"
                       r"[A-Za-z0-9])?)*$")
_DEVICES = re.compile(r"^[A-Za-z0-9_.:@-]+(,[A-Za-z0-9_.:@-]+)*$")  # UCX_NET_DEVICES: eth0, mlx5_0:1, all
# a server's environment on a host: the network device NIXL/UCX moves data on, the address of vLLM's NixlConnector
# side channel (KV), the host's name (its identity: processes with different ones never take a same-host shortcut)
DEVICES_ENV, SIDE_CHANNEL_ENV, HOST_ENV = "UCX_NET_DEVICES", "VLLM_NIXL_SIDE_CHANNEL_HOST", "EPD_HOST"


@dataclass(frozen=True)
class HostSpec:
    """One host of the block: where it is reached, which stages it serves, the device its data moves on."""

    address: str
    stages: tuple[str, ...]
    interface: str
    grpc_port: int = PORT_DEFAULTS["grpc_port"]
    http_port: int = PORT_DEFAULTS["http_port"]
    metrics_port: int = PORT_DEFAULTS["metrics_port"]

    @property
    def grpc(self) -> str:
        """Where an orchestrator on another host reaches this host's gRPC endpoint."""
        return f"{_bracketed(self.address)}:{self.grpc_port}"


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def parse_hosts(doc: Any, where: str, topology: Topology) -> dict[str, HostSpec]:
    """The ``hosts`` block of ``topology``'s file checked against it ({} without one); errors name the key."""
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not doc:
        raise TopologyError(f"{where}: expected a mapping of host name -> {{address, interface, stages, ...}}")
    hosts = {name: _host(name, spec, where, topology) for name, spec in doc.items()}
    _check_ports(hosts, where)
    _check_placement(hosts, where, topology)
    return hosts


def _host(name: Any, doc: Any, where: str, topology: Topology) -> HostSpec:
    if not isinstance(name, str) or not _LABEL.match(name):
        raise TopologyError(f"{where}: host name {name!r}: expected a DNS label (lower-case letters, digits and '-', "
                            f"at most 63, starting and ending with a letter or digit)")
    where = f"{where}.{name}"
    if not isinstance(doc, dict):
        raise TopologyError(f"{where}: expected a mapping with address, interface and stages")
    check_keys(doc, HOST_KEYS, where)
    for key in ("address", "interface", "stages"):
        if key not in doc:
            raise TopologyError(f"{where}.{key}: required (see backend.deploy.hosts)")
    ports = {key: doc.get(key, default) for key, default in PORT_DEFAULTS.items()}
    for key, port in ports.items():
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise TopologyError(f"{where}.{key}: expected a port number from 1 to 65535, got {port!r}")
    interface = doc["interface"]
    if not isinstance(interface, str) or not _DEVICES.match(interface):
        raise TopologyError(f"{where}.interface: expected a network device name for UCX_NET_DEVICES (eth0; several "
                            f"comma-separated; all), got {interface!r}")
    return HostSpec(_address(doc["address"], f"{where}.address"), _stages(doc["stages"], f"{where}.stages", topology),
                    interface, **ports)


def _address(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TopologyError(f"{where}: expected an IP address or DNS name, got {value!r}")
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        if not _DNS_NAME.match(value):
            raise TopologyError(f"{where}: expected an IP address or DNS name, got {value!r}") from None
        return value
    if address.is_unspecified:
        raise TopologyError(f"{where}: {value} binds every address but reaches none: give the one other hosts reach")
    return str(address)


def _stages(value: Any, where: str, topology: Topology) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
        raise TopologyError(f"{where}: expected a non-empty list of the topology's stages "
                            f"({', '.join(topology.stages)}), got {value!r}")
    twice = sorted({s for s in value if value.count(s) > 1})
    if twice:
        raise TopologyError(f"{where}: {', '.join(twice)} listed more than once")
    for stage in value:
        if stage in topology.stages:
            continue
        hosted = [HOSTS[deployment] for deployment in topology.colocated]
        if stage == Stage.ORCHESTRATOR.value and hosted:
            raise TopologyError(f"{where}: {stage}: the orchestrator runs inside the {' and '.join(hosted)} instances "
                                f"(orchestrator: colocated); place {' and '.join(hosted)} instead")
        raise TopologyError(f"{where}: {stage!r} is not a stage of this topology (its stages: "
                            f"{', '.join(topology.stages)})")
    return tuple(value)


def _check_ports(hosts: dict[str, HostSpec], where: str) -> None:
    seen: dict[tuple[str, int], str] = {}
    for name, host in hosts.items():
        for key in PORT_DEFAULTS:
            bound = (host.address, getattr(host, key))
            if bound in seen:
                raise TopologyError(f"{where}: {seen[bound]} and {name}.{key} are both {_bracketed(bound[0])}:{bound[1]}")
            seen[bound] = f"{name}.{key}"


def _check_placement(hosts: dict[str, HostSpec], where: str, topology: Topology) -> None:
    unplaced = [stage for stage in topology.stages if not any(stage in host.stages for host in hosts.values())]
    if unplaced:
        raise TopologyError(f"{where}: {', '.join(unplaced)} on no host (every stage the served deployments use "
                            f"needs one: {', '.join(topology.stages)})")
    for stage, spec in topology.stages.items():
        if spec.endpoint != LOCAL:
            raise TopologyError(f"{where.rsplit(': ', 1)[0]}: stages.{stage}.endpoint: the hosts block places the "
                                f"stages and gives the orchestrators their endpoints; remove endpoint")
    if topology.tier and not topology.tier["master"]:
        raise TopologyError(f"{where.rsplit(': ', 1)[0]}: tier: with a hosts block give tier.master and tier.metadata "
                            f"of a tier run elsewhere (each host would start a tier of its own; the launch commands "
                            f"start none)")


def with_endpoints(topology: Topology, places: dict[str, tuple[tuple[str, ...], str]], here: str) -> Topology:
    """``topology`` with the stage endpoints that an orchestrator at ``here`` is rendered with. ``places``: where the
    stages run (hosts here, tiers in ``backend.deploy.kubernetes``): name -> (its stages, its gRPC address). A stage
    is reached at the addresses of every place that carries it; the encoder at ``local`` where ``here`` is the only
    one; a stage hosting a colocated orchestrator is reached by no one."""
    stages = {}
    for stage, spec in topology.stages.items():
        carriers = [name for name, (held, _) in places.items() if stage in held]
        if stage not in ENDPOINT_STAGES or spec.orchestrator == "colocated":
            stages[stage] = spec
        elif stage == Stage.ENCODER.value and carriers == [here]:
            stages[stage] = replace(spec, endpoint=LOCAL)
        else:
            stages[stage] = replace(spec, endpoint=",".join(places[name][1] for name in carriers))
    return replace(topology, stages=stages)


def models_at(topology: Topology, stages: tuple[str, ...]) -> tuple[str, ...]:
    """The models of ``topology`` whose stage (instances, device) is one of ``stages``."""
    return tuple(name for name, kind in topology.models().items() if kind.stage in stages)


@dataclass(frozen=True)
class HostPlan:
    """What one host runs: its model repository (``files``, rendered for ``repository``) and its launch command
    (``argv`` with ``env`` laid over the caller's environment)."""

    name: str
    host: HostSpec
    models: tuple[str, ...]
    repository: Path
    files: dict[str, str]
    argv: tuple[str, ...]
    env: dict[str, str]

    def write(self) -> None:
        write_files(self.repository, self.files)

    def command(self) -> str:
        """The launch command as one shell line."""
        return shlex.join(["env", *(f"{k}={v}" for k, v in self.env.items()), *self.argv])


def plan_host(topology: Topology, name: str, repository: Path, tritonserver: str | Path = TRITONSERVER) -> HostPlan:
    """Host ``name``'s plan, its repository to be written at ``repository``."""
    if not topology.hosts:
        raise TopologyError(f"{topology.name}: no hosts block: one server serves it (render without --host)")
    if name not in topology.hosts:
        raise TopologyError(f"{topology.name}: no host {name!r} in its hosts block ({', '.join(topology.hosts)})")
    host, repository = topology.hosts[name], Path(repository).resolve()
    view = with_endpoints(topology, {n: (h.stages, h.grpc) for n, h in topology.hosts.items()}, name)
    models = models_at(view, host.stages)
    argv = launch_argv(tritonserver, repository, host.address, {key: getattr(host, key) for key in PORT_DEFAULTS})
    env = {DEVICES_ENV: host.interface, SIDE_CHANNEL_ENV: host.address, HOST_ENV: name}
    return HostPlan(name, host, models, repository, render_files(view, repository, models), argv, env)


def launch_argv(tritonserver: str | Path, repository: Path | str, address: str, ports: dict[str, int]) -> tuple[str, ...]:
    """tritonserver serving ``repository`` with its three endpoints bound to ``address`` on ``ports``
    (``PORT_DEFAULTS``' keys)."""
    return (str(tritonserver), f"--model-repository={repository}",
            *(f"--{kind}-{part}={value}" for kind in ("grpc", "http", "metrics")
              for part, value in (("address", address), ("port", ports[f"{kind}_port"]))))


def host_plan(topology: Topology, out: Path, tritonserver: str | Path = TRITONSERVER) -> dict[str, HostPlan]:
    """Every host's plan, host name -> ``HostPlan``, its repository at ``out/<host>`` (nothing written: ``write``)."""
    if not topology.hosts:
        raise TopologyError(f"{topology.name}: no hosts block: one server serves it (render without --host)")
    return {name: plan_host(topology, name, Path(out) / name, tritonserver) for name in topology.hosts}


def cli(topology: Topology, command: str, out: Path, host: str | None, tritonserver: str | None) -> int:
    """``render --host NAME`` and ``hosts`` of ``python -m backend.deploy.topology``."""
    binary = tritonserver or TRITONSERVER
    try:
        if command == "render":
            plans = {host: plan_host(topology, host, out, binary)}
        elif host is not None:
            raise TopologyError("--host goes with render; `hosts` renders every host")
        else:
            plans = host_plan(topology, out, binary)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, plan in plans.items():
        plan.write()
        print(f"# host {name} ({plan.host.address}, stages {', '.join(plan.host.stages)}): "
              f"{', '.join(plan.models)} in {plan.repository}\n{plan.command()}")
    return 0

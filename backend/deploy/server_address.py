"""Where an orchestrator reaches a generator stage (``pd``, ``prefill``, ``decode``) over gRPC.

A topology names each such stage's endpoint (``stages.<stage>.endpoint``, rendered into the orchestrator's
``<role>_endpoint`` parameters; the encoder's too, ``encoder_endpoint``): ``local``, the default, is the tritonserver
the orchestrator itself runs in (for the encoder: BLS in that server); otherwise a comma-separated list of other
servers' gRPC endpoints, ``host:port`` each, one per replica (``10.77.0.2:8001,10.77.0.3:8001``). A host name may
resolve to several addresses (a Kubernetes headless Service): the runtime takes every one of them as a replica. A
topology's ``hosts:`` block computes these lists (``backend.deploy.hosts``). ``local`` is resolved at load from that server's own
command line (a Python-backend stub is a child of tritonserver), so the repository works on whatever ports
the server was started with (``--grpc-port``, ``--grpc-address``), by ``make serve`` or by ``tritonserver``
run directly, with no environment variable to keep in step. A server started without gRPC
(``--allow-grpc=false``) cannot serve such a deployment, and the load fails saying so.

No Triton import: unit-tested with command lines.
"""
from __future__ import annotations

import os
from pathlib import Path

LOCAL = "local"
DEFAULT_PORT = 8001  # tritonserver's default --grpc-port
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1", "": "127.0.0.1"}


class EndpointError(ValueError):
    """An endpoint that cannot work: raised at load, naming the stage and what to change."""


def _options(argv: list[str]) -> dict[str, str]:
    """``--name=value`` and ``--name value`` options of a tritonserver command line (getopt_long's forms);
    a later one wins, as in tritonserver."""
    options: dict[str, str] = {}
    index = 1
    while index < len(argv):
        arg = argv[index]
        index += 1
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq and index < len(argv) and not argv[index].startswith("--"):
            value, index = argv[index], index + 1
        options[name] = value
    return options


def grpc_address(argv: list[str]) -> str:
    """The ``host:port`` a client on this host reaches the gRPC endpoint of the tritonserver started with
    ``argv`` at (a wildcard bind address is reached on loopback). Raises ``EndpointError`` when that server
    has no gRPC endpoint."""
    options = _options(argv)
    if options.get("allow-grpc", "true").strip().lower() in ("false", "0", "off", "no"):
        raise EndpointError("this tritonserver runs with --allow-grpc=false: it has no gRPC endpoint")
    port = options.get("grpc-port", str(DEFAULT_PORT))
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"cannot read this tritonserver's --grpc-port {port!r}")
    host = options.get("grpc-address", "0.0.0.0")
    host = _WILDCARDS.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def server_argv(pid: int | None = None) -> list[str]:
    """The command line of this process's tritonserver (the parent of a Python-backend stub)."""
    pid = os.getppid() if pid is None else pid
    try:
        argv = [part.decode() for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if part]
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError as exc:
        raise EndpointError(f"cannot read the command line of the server process {pid}: {exc}") from None
    if exe != "tritonserver":
        raise EndpointError(f"the parent process {pid} ({exe}) is not tritonserver, so 'local' has no address")
    return argv


def resolve(stage: str, endpoint: str, argv: list[str] | None = None) -> str:
    """The gRPC address of ``stage`` for the configured ``endpoint``: ``local``'s, or the ``host:port`` list as
    given (checked; ``endpoint_list`` splits it). Raises ``EndpointError`` naming the stage and the setting to change."""
    endpoint = (endpoint or LOCAL).strip()
    hint = f"set stages.{stage}.endpoint in the topology to the host:port of a server that serves {stage}"
    if endpoint != LOCAL:
        check_endpoint(stage, endpoint)
        return endpoint
    try:
        return grpc_address(server_argv() if argv is None else argv)
    except EndpointError as exc:
        raise EndpointError(f"stage {stage} is reached over this server's gRPC endpoint (endpoint: local), "
                            f"but {exc}; start tritonserver with gRPC on, or {hint}") from None


def endpoint_list(endpoint: str) -> list[str]:
    """The ``host:port`` addresses of an endpoint setting, one per replica, as written (``local``: none)."""
    endpoint = (endpoint or LOCAL).strip()
    return [] if endpoint == LOCAL else [item.strip() for item in endpoint.split(",")]


def check_endpoint(stage: str, endpoint: str) -> None:
    """``local``, or one or more ``host:port`` with a port number, comma-separated (one per replica, each once);
    raises ``EndpointError`` otherwise, naming the setting."""
    where = f"stages.{stage}.endpoint"
    items = endpoint_list(endpoint)
    for item in items:
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            problem = "" if len(items) == 1 else f": {item!r} is not host:port"
            raise EndpointError(f"{where}: expected 'local' or host:port, got {endpoint!r}{problem} "
                                f"(several replicas: host:port,host:port)")
    twice = sorted({item for item in items if items.count(item) > 1})
    if twice:
        raise EndpointError(f"{where}: {', '.join(twice)} listed more than once in {endpoint!r} (one entry per replica)")

"""Where an orchestrator reaches a generator stage (``pd``, ``prefill``, ``decode``) over gRPC.

A topology names each such stage's endpoint (``stages.<stage>.endpoint``, rendered into the orchestrator's
``<role>_endpoint`` parameters): ``local``, the default, is the tritonserver the orchestrator itself runs in;
``host:port`` is another server's gRPC endpoint. ``local`` is resolved at load from that server's own
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
    """The gRPC address of ``stage`` for the configured ``endpoint`` (``local`` or ``host:port``). Raises
    ``EndpointError`` naming the stage and the setting to change."""
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


def check_endpoint(stage: str, endpoint: str) -> None:
    """``local`` or ``host:port`` with a port number; raises ``EndpointError`` otherwise."""
    if endpoint == LOCAL:
        return
    host, colon, port = endpoint.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"stages.{stage}.endpoint: expected 'local' or host:port, got {endpoint!r}")

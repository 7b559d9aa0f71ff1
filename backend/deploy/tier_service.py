"""The shared embedding tier's service: a Mooncake Store master (``mooncake_master``, with its HTTP metadata server)
and the holder of its byte budget (``mooncake_client``) on 127.0.0.1, started and stopped like the server is (the
launcher and the tests: ``launch_for``), never by hand.

Where Mooncake comes from (docs/tier.md, "Set-up"): ``.venv-mooncake`` beside ``.venv`` (scripts/setup_mooncake.sh;
``EPD_MOONCAKE_VENV`` names another), its ``site-packages`` (appended to an encoder's ``sys.path``, after the
project's own packages) and ``mooncake_master`` / ``mooncake_client`` binaries, and the private libibverbs/libnl it
links under ``.venv-mooncake/private-libs`` (``EPD_MOONCAKE_LIBS``: other colon-separated directories), put on
``LD_LIBRARY_PATH`` of the master, the holder and the server (the loader reads it at a process's start).
Standard library only: the deploy layer imports nothing heavier.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from backend.deploy.ports import free_ports

VENV_ENV, LIBS_ENV = "EPD_MOONCAKE_VENV", "EPD_MOONCAKE_LIBS"
# how the launcher tells the encoder instances where the tier it started is (EncoderSettings.tier_master: "" reads them)
MASTER_ENV, METADATA_ENV = "EPD_TIER_MASTER", "EPD_TIER_METADATA"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ROOT / ".venv-mooncake"
PRIVATE_LIBS = "private-libs"
LOG = logging.getLogger("epd.tier")


def free_port() -> int:
    """A port for the store's listeners, below the ephemeral range (``backend.deploy.ports``: one ``bind(0)`` handed
    out could be any outgoing connection's local port by the time the store binds it)."""
    return free_ports()[0]


def mooncake_paths() -> tuple[Path, Path, str] | None:
    """(the venv's site-packages, the master binary, the library path) of the Mooncake venv (``EPD_MOONCAKE_VENV``,
    else ``.venv-mooncake``) where it has mooncake installed; None otherwise (the tier is then unavailable, and says
    so). The library path: ``EPD_MOONCAKE_LIBS``, else the directories of the venv's ``private-libs`` holding
    libraries."""
    venv = Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)
    found = sorted(venv.glob("lib/python3*/site-packages/mooncake/mooncake_master"))
    if not found:
        return None
    libs = os.environ.get(LIBS_ENV)
    if libs is None:
        libs = os.pathsep.join(sorted({str(lib.parent) for lib in (venv / PRIVATE_LIBS).rglob("lib*.so*")}))
    return found[0].parent.parent, found[0], libs


def library_env(libs: str, env: dict | None = None) -> dict:
    """``env`` (this process's by default) with ``libs`` in front of ``LD_LIBRARY_PATH``."""
    env = dict(os.environ if env is None else env)
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libs, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


class _Service:
    """A child process of ours: ``stop`` sends SIGTERM and waits (SIGKILL after ``stop_timeout``); ``kill`` is
    SIGKILL (the tests' "it died")."""

    process: subprocess.Popen | None
    stop_timeout: float = 10.0

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _launch(self, command: list[str], libs: str, log_path: str, ready, timeout: float) -> None:
        """Start ``command`` (output appended to ``log_path``) and wait until ``ready()``, or raise naming the log."""
        name = Path(command[0]).name
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=library_env(libs),
                                            start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.process.returncode} (log: {log_path})")
            if ready():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{name} was not ready within {timeout} s (log: {log_path})")


@dataclass
class MooncakeMaster(_Service):
    """One ``mooncake_master`` on free 127.0.0.1 ports (the same ones again after a ``start`` that follows a
    ``stop``); ``start`` waits until its RPC and metadata ports accept."""

    binary: Path | None = None
    libs: str = ""
    log_path: str = "/tmp/mooncake_master.log"
    eviction_high_watermark: float = 0.9
    lease_ttl_ms: int = 10_000
    client_ttl_s: int = 10
    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    def __post_init__(self):
        if self.binary is None:
            paths = mooncake_paths()
            if paths is None:
                raise RuntimeError(f"mooncake_master not found: set {VENV_ENV} to a venv with "
                                   "mooncake-transfer-engine-non-cuda installed (docs/tier.md)")
            _, self.binary, self.libs = paths

    def command(self) -> list[str]:
        return [str(self.binary), f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
                "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
                f"-http_metadata_server_port={self.http_port}", f"-metrics_port={self.metrics_port}",
                f"-eviction_high_watermark_ratio={self.eviction_high_watermark}",
                f"-default_kv_lease_ttl={self.lease_ttl_ms}", f"-client_ttl={self.client_ttl_s}"]

    def start(self, timeout: float = 30.0) -> MooncakeMaster:
        self._launch(self.command(), self.libs, self.log_path,
                     lambda: all(_accepts(port) for port in (self.rpc_port, self.http_port)), timeout)
        return self

    def client_config(self) -> dict:
        """What a store client's ``setup`` takes to reach this master."""
        return {"local_hostname": "127.0.0.1", "metadata": f"http://127.0.0.1:{self.http_port}/metadata",
                "rpc": f"127.0.0.1:{self.rpc_port}"}


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (a launcher killed hard must not
    leave the tier running)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class MooncakeHolder(_Service):
    """The tier's memory: one ``mooncake_client`` (Mooncake's standalone client) mounting ``budget_bytes`` into the
    master's pool, so entries outlive the encoder instances that wrote them (an encoder's own segment goes with it)."""

    master: MooncakeMaster
    budget_bytes: int
    log_path: str = "/tmp/mooncake_holder.log"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        config = self.master.client_config()
        return [str(self.master.binary.parent / "mooncake_client"), f"-global_segment_size={self.budget_bytes}",
                "-host=127.0.0.1", f"-port={self.port}", f"-master_server_address={config['rpc']}",
                f"-metadata_server={config['metadata']}", "-protocol=tcp"]

    def start(self, timeout: float = 30.0) -> MooncakeHolder:
        """Start it and wait until it has mounted its segment (a log line after this start's offset)."""
        offset = Path(self.log_path).stat().st_size if Path(self.log_path).exists() else 0
        self._launch(self.command(), self.master.libs, self.log_path,
                     lambda: _accepts(self.port) and b"Mounting segment" in Path(self.log_path).read_bytes()[offset:],
                     timeout)
        return self


def start_tier(budget_bytes: int, log_dir: str = "/tmp", **master_options) -> tuple[MooncakeMaster, MooncakeHolder]:
    """The tier's service: a master and the holder of its ``budget_bytes`` (stop both with ``stop_tier``)."""
    master = MooncakeMaster(log_path=f"{log_dir}/mooncake_master.log", **master_options).start()
    try:
        return master, MooncakeHolder(master, budget_bytes, log_path=f"{log_dir}/mooncake_holder.log").start()
    except Exception:
        master.stop()
        raise


def stop_tier(master: MooncakeMaster, holder: MooncakeHolder) -> None:
    holder.stop()
    master.stop()


_PARAMETER = re.compile(r'parameters \{ key: "(tier_[a-z_]+)" value: \{ string_value: "([^"]*)" \} \}')


def tier_parameters(repository: Path) -> dict[str, str]:
    """The ``tier_*`` parameters of the repository's ``encoder`` (as ``backend.deploy.render`` writes them; {} where
    there is no encoder or no tier)."""
    config = Path(repository) / "encoder" / "config.pbtxt"
    return dict(_PARAMETER.findall(config.read_text())) if config.is_file() else {}


@dataclass
class TierRun:
    """The tier a launcher started for one server: ``env`` is what the server's processes need to use it."""

    master: MooncakeMaster
    holder: MooncakeHolder

    def env(self, base: dict) -> dict:
        """``base`` with the tier's addresses, Mooncake's libraries on ``LD_LIBRARY_PATH``, and UCX's InfiniBand module
        off (libibverbs is loadable in these processes now; docs/tier.md)."""
        config = self.master.client_config()
        env = library_env(self.master.libs, base)
        env.update({MASTER_ENV: config["rpc"], METADATA_ENV: config["metadata"]})
        env.setdefault("UCX_MODULES", "^ib")
        return env

    def stop(self) -> None:
        stop_tier(self.master, self.holder)

    def serve(self, command: list[str], env: dict) -> int:
        """Run the server ``command`` in the foreground with this tier (``env`` + ``self.env``) and stop the tier after
        it (``backend.deploy.local_server``): the server stays in this process's group (Ctrl-C reaches it; a ``TritonServer``
        launcher command finds it there); SIGTERM to this process is passed on to it. Returns its exit status."""
        server = None
        try:
            server = subprocess.Popen(command, env=self.env(env))
            signal.signal(signal.SIGTERM, lambda signum, frame: server.send_signal(signal.SIGTERM))
            while True:
                try:
                    return server.wait()
                except KeyboardInterrupt:  # the server got the Ctrl-C too: wait for it to stop
                    continue
        finally:
            if server is not None and server.poll() is None:
                server.kill()
                server.wait()
            self.stop()


def remote_tier_env(repository: Path, env: dict) -> dict:
    """``env`` for a server whose encoder uses a tier run elsewhere (``tier_master`` given: nothing to start here):
    Mooncake's libraries on ``LD_LIBRARY_PATH`` and UCX's InfiniBand module off, as ``TierRun.env`` gives a tier
    started here; ``env`` unchanged for any other repository (or without Mooncake installed)."""
    paths = mooncake_paths()
    if not tier_parameters(repository).get("tier_master") or paths is None:
        return env
    env = library_env(paths[2], env)
    env.setdefault("UCX_MODULES", "^ib")
    return env


def launch_for(repository: Path, log_dir: str = "/tmp") -> TierRun | None:
    """The tier of the repository's encoder, started (its master and holder): where its config asks for one
    (``tier_bytes`` > 0) and names no master of its own (``tier_master``). None: no tier to start, or Mooncake not
    installed (logged: the encoders then run without the tier)."""
    params = tier_parameters(repository)
    if int(params.get("tier_bytes", 0) or 0) <= 0 or params.get("tier_master"):
        return None
    if mooncake_paths() is None:
        LOG.warning("the topology asks for the embedding tier, but Mooncake is not installed (%s; "
                    "scripts/setup_mooncake.sh): serving without it", DEFAULT_VENV)
        return None
    return TierRun(*start_tier(int(params["tier_bytes"]), log_dir=log_dir))

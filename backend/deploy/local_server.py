"""Start and stop a real ``tritonserver`` on 127.0.0.1 with the environment the Python backend needs.

Used by ``make serve`` (foreground), ``make demo``, the e2e tests and the benchmarks. The binary and
the Python backend come from the ``nvidia-pytriton`` wheel in the project venv (see scripts/setup.sh).

    python -m backend.deploy.local_server [--model-repository DIR]   # foreground, ports from HTTP_PORT/GRPC_PORT/METRICS_PORT
    .venv/bin/tritonserver --model-repository model_repository --grpc-port 9001 ...   # tritonserver's own flags

``.venv/bin/tritonserver`` (the console script ``tritonserver``, ``exec_tritonserver``) is the real binary
with the environment the Python backend needs and the venv's backend and cache directories; any flag
tritonserver takes is passed through (addresses default to 127.0.0.1 unless given).

A repository whose ``encoder`` has the shared embedding tier on (a topology's ``tier:`` block; docs/tier.md) gets it
from here: ``main`` and ``TritonServer`` start its Mooncake master and holder on free 127.0.0.1 ports before
tritonserver, give the server their addresses and Mooncake's libraries (``backend.deploy.tier_service.TierRun.env``),
and stop them after tritonserver has stopped, also when it failed to start.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from backend.deploy.ports import free_ports
from backend.deploy.render import render
from backend.deploy.schema import TopologyError
from backend.deploy.stacks import LOAD_FAILURES, gdb_stacks, report_native_stacks
from backend.deploy.tier_service import launch_for, remote_tier_env
from backend.deploy.topology import load

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"
DEFAULT_REPOSITORY = ROOT / "model_repository"


def _site_packages() -> Path:
    return VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def triton_home() -> Path:
    home = _site_packages() / "pytriton" / "tritonserver"
    if not (home / "bin" / "tritonserver").exists():
        raise FileNotFoundError(f"tritonserver not found under {home}; run `make setup`")
    return home


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The venv's python first on PATH (the stub finds its environment through it), libpython on the
    loader path, UCX kept on loopback, and a UTF-8 locale for child processes."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = f"{VENV / 'bin'}:{env.get('PATH', '')}"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("LC_ALL", "C.UTF-8")
    return env


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def free(cls) -> "Ports":
        return cls(*free_ports(3))

    @classmethod
    def from_env(cls) -> "Ports":
        return cls(int(os.environ.get("HTTP_PORT", 8000)), int(os.environ.get("GRPC_PORT", 8001)),
                   int(os.environ.get("METRICS_PORT", 8002)))

    def as_env(self) -> dict[str, str]:
        """The environment ``from_env`` reads (what ``make serve`` and ``local_server`` serve on)."""
        return {"HTTP_PORT": str(self.http), "GRPC_PORT": str(self.grpc), "METRICS_PORT": str(self.metrics)}


def command(repository: Path, ports: Ports, extra: list[str] = ()) -> list[str]:
    return tritonserver_argv([f"--model-repository={repository}", f"--http-port={ports.http}",
                              f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}", *extra])


def tritonserver_argv(args: list[str]) -> list[str]:
    """The real binary with ``args``, after the defaults of this venv for the flags ``args`` does not give:
    its backend and cache directories, 127.0.0.1 addresses, no GPU metrics on a machine without a GPU (else
    NVML/DCGM failures are logged at every start)."""
    home = triton_home()
    defaults = {"--backend-directory": home / "backends", "--cache-directory": home / "caches",
                "--http-address": "127.0.0.1", "--grpc-address": "127.0.0.1", "--metrics-address": "127.0.0.1"}
    if not Path("/dev/nvidia0").exists():
        defaults["--allow-gpu-metrics"] = "false"
    given = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    # every config.pbtxt here is complete (rendered); left on, the Python backend runs a stub of its own per model
    # to ask model.py for a completed config, and stops it: ~1.3 s of CPU a model (docs/results/ci-time.md)
    complete = [] if given & {"--disable-auto-complete-config", "--strict-model-config"} \
        else ["--disable-auto-complete-config"]
    return [str(home / "bin" / "tritonserver"),
            *(f"{flag}={value}" for flag, value in defaults.items() if flag not in given), *complete, *args]


SLOW_STOP_SECONDS = 14.0  # a stop slower than this logs its stubs' native stacks (a family server's: ~8 s)


def log_tail(path, lines: int = 40) -> str:
    """The last ``lines`` of a server's log, for the error that says it failed: a CI run keeps the error, not
    the log (a clean clone's /tmp is gone when its report is read)."""
    try:
        text = Path(path).read_bytes()[-16384:].decode(errors="replace") if path else ""
    except OSError:
        return ""
    return "\n--- the log's last lines ---\n" + "\n".join(text.splitlines()[-lines:]) if text else ""


def exec_tritonserver() -> None:
    """The ``tritonserver`` console script: exec the real binary with the Python backend's environment."""
    argv = tritonserver_argv(sys.argv[1:])
    os.execve(argv[0], argv, server_env())


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (the server started its own session)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _kill_leaving_trackers_last(pgid: int, members: list[int]) -> None:
    """SIGKILL ``members`` of process group ``pgid`` but multiprocessing's resource trackers, give the trackers 3 s
    to exit on their own, then SIGKILL what is left of the group. A tracker unlinks what the processes it served
    registered (an EngineCore's ``/dev/shm/sem.mp-*``) once they are all gone; killed with them, it leaves that
    behind (CI, 2026-12-03: a pd stub's EngineCore and its tracker outlived the server and one semaphore stayed)."""
    trackers = [pid for pid in members if _is_resource_tracker(pid)]
    for pid in set(members) - set(trackers):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 3
    while trackers and time.monotonic() < deadline:
        time.sleep(0.1)
        trackers = [pid for pid in trackers if pid in group_members(pgid)]
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(0.2)


PYTHON_ENV_GLOB = "/tmp/python_env_*"  # tritonserver's Python backend: mkdtemp("/tmp/python_env_XXXXXX"), fixed
BACKEND_INIT_S = 10.0  # a server makes its Python backend's directory this soon after it starts (measured: ~2 s)


def python_envs() -> set[str]:
    return {str(p) for p in Path("/").glob(PYTHON_ENV_GLOB.lstrip("/"))}


def remove_python_envs(before: set[str], window: list[float | None]) -> list[str]:
    """Remove the empty Python-backend directories a stopped server left. The backend makes one
    (``/tmp/python_env_XXXXXX``, a fixed place) when it loads and removes it only at a clean exit, so every server
    killed or ended by its exit timeout left one (3 per CI run). Which one was the server's is written nowhere: a
    directory that appeared while it started (``window``: its start and readiness, wall clock; ``before``: what was
    there before) is removed unless a running tritonserver started just before the directory was made, whose
    directory it could be (started servers running side by side: the last of them to stop removes them). Returns the
    removed paths."""
    start, ready = window
    if start is None:
        return []
    ready = ready or time.time()
    removed = []
    for path, made in unowned_python_envs(before).items():
        try:
            if start - 1 <= made <= ready + 1:
                os.rmdir(path)  # empty, or left alone (a model's extracted EXECUTION_ENV_PATH)
                removed.append(path)
        except OSError:
            continue
    return removed


def unowned_python_envs(before: set[str]) -> dict[str, float]:
    """The Python-backend directories new since ``before`` that no running tritonserver can have made (none started
    within ``BACKEND_INIT_S`` before the directory was), with the time each was made."""
    candidates = python_envs() - before
    running = _tritonserver_starts() if candidates else []
    unowned = {}
    for path in sorted(candidates):
        try:
            made = os.stat(path).st_ctime
        except OSError:
            continue
        if not any(made - BACKEND_INIT_S <= t <= made + 1 for t in running):
            unowned[path] = made
    return unowned


def _tritonserver_starts() -> list[float]:
    """The start times (wall clock) of the tritonserver processes running now."""
    import psutil

    starts = []
    for proc in psutil.process_iter(["exe", "create_time", "status"]):
        info = proc.info
        if (info["exe"] or "").endswith("/tritonserver") and info["status"] != psutil.STATUS_ZOMBIE:
            starts.append(info["create_time"] or 0.0)
    return starts


SHM_REGION_PREFIX = "triton_python_backend_shm_region_"


def stub_regions(pgid: int) -> set[str]:
    """The /dev/shm regions of the Python backend stubs in process group ``pgid`` (each stub names its
    region on its command line)."""
    regions = set()
    for pid in group_members(pgid):
        try:
            parts = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        regions |= {part.decode() for part in parts if part.startswith(SHM_REGION_PREFIX.encode())}
    return regions


class TritonServer:
    """A tritonserver child process; ``with TritonServer(...) as s:`` waits for ready and always stops it."""

    def __init__(self, repository: Path = DEFAULT_REPOSITORY, ports: Ports | None = None,
                 log_path: Path | None = None, extra_args: list[str] = (), env: dict[str, str] | None = None,
                 argv: list[str] | Callable[[Ports], list[str]] | None = None, start_timeout: float = 300.0):
        """``argv``: start this command instead of tritonserver (e.g. ``make serve``, the console script), in a
        session of its own, with ``env`` and the ports' variables (``Ports.as_env``: what a launcher serves on);
        a command that names the ports itself is given as a function of them, so that ports picked here can be
        picked again (``start``). ``start_timeout``: how long ``with`` waits for ready."""
        self.argv = argv
        self.started_argv: list[str] | None = None  # the command of the last start
        self.start_timeout = start_timeout
        self.repository = Path(repository)
        self.ports = ports or Ports.free()
        self._own_ports = ports is None  # picked here: picked again if another process takes one first
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.ready_seconds: float | None = None
        self.stragglers: list[int] = []
        self.died = ""  # set by stop when the server had exited by itself: its exit status and its log's last lines
        self._signalled = False  # stop has run (a second stop finds the server gone: not a death)
        self._sigterm = None  # the SIGTERM handler __enter__ replaced, put back at __exit__
        self.stop_seconds: float | None = None  # SIGTERM to exit
        self.leftover_shm: list[str] = []  # stub regions the server left in /dev/shm (stop removed them)
        self.leftover_envs: list[str] = []  # the Python backend's /tmp/python_env_* it left (stop removed them)
        self._envs_before: set[str] = set()
        self._window: list[float | None] = [None, None]  # wall-clock start and ready of the last start
        self.regions: set[str] = set()  # the stubs' /dev/shm regions, seen when ready and at stop
        self.server_pid: int | None = None  # tritonserver's (proc's, unless argv is a launcher), once ready
        self.tier = None  # the embedding tier started for the repository (tier_service.TierRun), while it runs

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"

    def start(self, timeout: float = 300.0) -> "TritonServer":
        """Start and wait until ready. A port picked here that another process bound before tritonserver
        did (free ports are only free when picked) is picked again, twice at most; a start that failed in one of the
        Python backend's known ways at load (``LOAD_FAILURES``) is made again, twice at most."""
        for attempt in range(3):
            try:
                return self._start(timeout)
            except RuntimeError:
                if attempt < 2 and self._failed_at_load(attempt):
                    continue
                if not (self._own_ports and attempt < 2 and self._port_taken()):
                    raise
                self.ports = Ports.free()
        raise AssertionError("unreachable")

    def _failed_at_load(self, attempt: int) -> bool:
        """Whether the start failed in one of the Python backend's known ways at load (``LOAD_FAILURES``: tritonserver
        gave up on a stub that was loading well, its health check having missed a one-second window on a loaded
        machine, ``backend.triton.load_watch``; or it aborted on a shared-memory lock); its log is kept beside (``.N``
        after the name) and the server is started again."""
        try:
            text = Path(self.log_path).read_bytes() if self.log_path else b""
        except OSError:
            return False
        failure = next((f for f in LOAD_FAILURES if f.encode() in text), None)
        if failure is None:
            return False
        kept = Path(f"{self.log_path}.{attempt + 1}")
        shutil.copyfile(self.log_path, kept)
        # a warning: pytest's summary lists it (from xdist's workers too) where a passing test's output is not shown
        warnings.warn(f"tritonserver failed while its models loaded ({failure!r}; its log: {kept}); starting it again",
                      RuntimeWarning, stacklevel=2)
        return True

    def _port_taken(self) -> bool:
        try:
            return b"already in use" in Path(self.log_path).read_bytes() if self.log_path else False
        except OSError:
            return False

    def _start(self, timeout: float) -> "TritonServer":
        if self.log_path:  # e.g. a benchmark's .cache/ on a fresh checkout
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        started = time.monotonic()
        self._envs_before, self._window = python_envs(), [time.time(), None]
        try:
            argv = (self.argv(self.ports) if callable(self.argv) else self.argv) \
                or command(self.repository, self.ports, self.extra_args)
            if self.argv:
                env = {**(os.environ if self.env is None else self.env), **self.ports.as_env()}
            else:  # a launcher command (make serve) starts its tier itself
                env = self._with_tier(server_env(self.env))
            self.started_argv = list(argv)
            self.died, self._signalled = "", False  # a start tried again (a port taken) begins anew
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            if self.log_path:
                out.close()
        try:
            while time.monotonic() - started < timeout:
                self.regions |= stub_regions(self.proc.pid)  # also those of stubs a crash at load leaves behind
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tritonserver exited with {self.proc.returncode}; log: {self.log_path}"
                                       f"{log_tail(self.log_path)}")
                if self.is_ready() and self._metrics_up():
                    self.ready_seconds = time.monotonic() - started
                    self._window[1] = time.time()
                    self.server_pid = self._server_pid()
                    self.regions |= stub_regions(self.proc.pid)
                    return self
                time.sleep(0.25)
            # what each of its processes was doing (a model that never finished loading), into the log first;
            # tritonserver's own threads through gdb where there is one (py-spy reads Python processes only)
            report_native_stacks(group_members(self.proc.pid), self.log_path)
            if (server := self._server_pid()) and (text := gdb_stacks(server, keep="backend::python")):
                with open(self.log_path, "a") if self.log_path else open(os.devnull, "w") as log:
                    log.write(text)
            raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s; log: {self.log_path}"
                               f"{log_tail(self.log_path)}")
        except BaseException as exc:  # whatever ends the wait (Ctrl-C too): nothing of the server is left behind
            self.stop()  # the stubs and their regions go too
            if isinstance(exc, RuntimeError) and self.leftover_shm:
                raise RuntimeError(f"{exc}; removed the /dev/shm regions its stubs left") from None
            raise

    def _with_tier(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` for a server with the repository's embedding tier, started here if it has one and it is not up."""
        if self.tier is None:
            self.tier = launch_for(self.repository, str(Path(self.log_path).parent) if self.log_path else "/tmp")
        return self.tier.env(env) if self.tier is not None else remote_tier_env(self.repository, env)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (OSError, http.client.HTTPException):  # not up, or something else answers there (not HTTP)
            return False

    def _metrics_up(self) -> bool:
        """The metrics endpoint starts after the HTTP one: a test that scrapes right after readiness saw
        its connection refused (under load)."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as resp:
                return resp.status == 200
        except (OSError, http.client.HTTPException):
            return False

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the server (it unloads models and stops their stubs), SIGKILL it if it hangs; then make
        sure nothing of its process group survives (a stub killed hard leaves its vLLM EngineCore behind); then the
        embedding tier's service, if one was started for it."""
        try:
            self._stop_server(timeout)
        finally:
            if self.tier is not None:
                self.tier, tier = None, self.tier
                tier.stop()

    def _stubs(self) -> list[int]:
        """The Python-backend stubs of this server's process group."""
        stubs = []
        for pid in group_members(self.proc.pid):
            try:
                if b"triton_python_backend_stub" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    stubs.append(pid)
            except OSError:
                continue
        return stubs

    def _stop_server(self, timeout: float) -> None:
        if self.proc is None:
            return
        regions = self.regions | stub_regions(self.proc.pid)
        if self.proc.poll() is not None and not self._signalled:
            self.died = f"tritonserver exited by itself with {self.proc.returncode}{log_tail(self.log_path, 80)}"
        self._signalled = True
        if self.proc.poll() is None:
            started = time.monotonic()
            os.kill(self._server_pid(), signal.SIGTERM)  # a launcher (make serve) exits with its server
            try:
                self.proc.wait(timeout=min(SLOW_STOP_SECONDS, timeout))
            except subprocess.TimeoutExpired:
                # a slow stop: where its stubs are, C frames too, into the log (a stub that waits after its
                # finalize shows no Python frame in its own watchdog's dump: docs/results/robustness.md)
                report_native_stacks(self._stubs(), self.log_path, echo=False)
                try:
                    self.proc.wait(timeout=max(0.0, timeout - (time.monotonic() - started)))
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
            self.stop_seconds = time.monotonic() - started
        # Stubs and engine processes exit with the server: the ones that did not in 20 s are recorded, then killed
        deadline = time.monotonic() + 20
        while (left := group_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.stragglers = left
        if left:
            report_native_stacks(left, self.log_path)  # py-spy's view first: C frames too
            for pid in left:  # a stub prints its threads' stacks into the log first (backend.engine.host.prepare_process)
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
            _kill_leaving_trackers_last(self.proc.pid, left)
        # A stub that died (killed while serving, or by the server at its exit timeout: a model that never
        # finished unloading) leaves its shared-memory region behind; record it (tests assert what they
        # expect) and remove it.
        # The same for the in-band cancel boards of its models (orchestrator.cancel_board) and its encoders'
        # announcements (backend.transfer.announce), which unload removes.
        server = self.server_pid or self.proc.pid
        boards = [p.name for pattern in (f"epd-cancel-{server}-*", f"epd-producers-{server}")
                  for p in Path("/dev/shm").glob(pattern)]
        self.leftover_envs = remove_python_envs(self._envs_before, self._window)
        self.leftover_shm = sorted([name for name in regions if os.path.exists(f"/dev/shm/{name}")] + boards)
        for name in self.leftover_shm:
            if name in boards:
                shutil.rmtree(f"/dev/shm/{name}", ignore_errors=True)
            else:
                Path(f"/dev/shm/{name}").unlink(missing_ok=True)

    def _server_pid(self) -> int:
        """The tritonserver process: ours, or the one a launcher command (``argv``) started in our session."""
        if not self.argv:
            return self.proc.pid
        for pid in group_members(self.proc.pid):
            try:
                if os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "tritonserver":
                    return pid
            except OSError:
                continue
        return self.proc.pid

    def __enter__(self) -> "TritonServer":
        self._sigterm = _exit_on_sigterm()
        return self.start(self.start_timeout)

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
        if self.died and exc[0] is None:  # the tests saw only refused connections: say why, with the log (CI keeps no /tmp)
            raise RuntimeError(f"{self.died}\nprocesses that outlived it: {self.stragglers}")


def _exit_on_sigterm():
    """Make SIGTERM raise SystemExit in this (main) thread while a server is up, so ``with TritonServer()`` stops
    the server and its engines on ``timeout`` or ``kill`` as on Ctrl-C (the server runs in a process group of its
    own: without this, a benchmark killed by ``timeout`` left every engine holding its GPU memory). Returns the
    handler to restore; None where one is set already or this is not the main thread."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    return signal.SIG_DFL


def render_topology(topology: Path, checkpoint: Path | None = None, openai_port: int = 0,
                    engine_args: dict[str, Any] | None = None) -> tuple[Path, int]:
    """Render ``topology`` (with ``checkpoint`` in place of its own, ``engine_args`` laid over its own) into
    ``.cache/repositories/<name>``. A topology with ``openai_port`` serves the OpenAI endpoint from its served model's
    process: ``openai_port`` (non-zero) replaces its port. Returns the repository and that in-process endpoint's port
    (0: the topology has none)."""
    served = load(topology, checkpoint=checkpoint)
    if engine_args:
        served = replace(served, engine_args={**served.engine_args, **engine_args})
    if served.openai_port and openai_port:
        served = replace(served, openai_port=openai_port)
    out = ROOT / ".cache" / "repositories" / served.name
    render(served, out)
    return out, served.openai_port


def engine_arg(text: str) -> tuple[str, Any]:
    """``--engine-arg``'s ``KEY=VALUE``: VALUE as JSON where it parses (numbers, booleans, objects), else the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or key.strip() == "model":
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, a vLLM engine argument other than model "
                                         "(the checkpoint is --checkpoint)")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run tritonserver in the foreground on 127.0.0.1.")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--topology", type=Path, help="render this topology and serve it (instead of --model-repository)")
    parser.add_argument("--checkpoint", type=Path, help="with --topology: serve this checkpoint directory")
    parser.add_argument("--openai-port", type=int, default=0,
                        help="also serve the OpenAI-compatible endpoint (frontend.openai) on this port; 0: leave it out "
                             "(with a --topology that has openai_port: that in-process endpoint's port)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", type=engine_arg,
                        help="with --topology: a vLLM engine argument laid over the topology's engine_args for every "
                             "engine (VALUE read as JSON where it parses, else as text), e.g. "
                             "kv_cache_memory_bytes=268435456; repeatable")
    parser.add_argument("extra", nargs="*", help="more tritonserver arguments (after --)")
    args = parser.parse_args(argv)
    if args.checkpoint and not args.topology:
        parser.error("--checkpoint goes with --topology")
    if args.engine_arg and not args.topology:
        parser.error("--engine-arg goes with --topology")
    repository = args.model_repository.resolve()
    if args.topology:
        try:
            repository, in_process = render_topology(args.topology, args.checkpoint, args.openai_port,
                                                     dict(args.engine_arg))
        except TopologyError as exc:
            parser.exit(2, f"error: {exc}\n")
        print(f"rendered {args.topology} into {repository}", flush=True)
        if in_process:
            print(f"OpenAI-compatible endpoint (in the served model's process) on http://127.0.0.1:{in_process}/v1",
                  flush=True)
            args.openai_port = 0
    ports = Ports.from_env()
    cmd = command(repository, ports, args.extra)
    if args.openai_port:
        start_openai(args.openai_port, ports.grpc, repository)
    tier = launch_for(repository, os.environ.get("EPD_TIER_LOG_DIR", "/tmp"))
    if tier is None:
        os.execve(cmd[0], cmd, remote_tier_env(repository, server_env()))
    print(f"embedding tier: Mooncake master on 127.0.0.1:{tier.master.rpc_port}", flush=True)
    sys.exit(tier.serve(cmd, server_env()))



def start_openai(port: int, grpc_port: int, repository: Path | None = None) -> subprocess.Popen:
    """The OpenAI-compatible endpoint beside the tritonserver this process is about to become (``execve``): it exits
    when this process does (``--with-parent``), so it stops with the server. Its tool calls use the checkpoint the
    ``repository`` serves (``--tokenizer``), where one is found."""
    print(f"OpenAI-compatible endpoint on http://127.0.0.1:{port}/v1", flush=True)
    checkpoint = checkpoint_of(repository) if repository is not None else None
    return start_openai_process(port, f"127.0.0.1:{grpc_port}", "--with-parent",
                                *(("--tokenizer", str(checkpoint)) if checkpoint else ()))


def checkpoint_of(repository: Path) -> Path | None:
    """The checkpoint folder a rendered repository's engines load (the first ``model.json``'s ``model``, relative
    to its folder), or None."""
    for path in sorted(Path(repository).glob("*/model.json")):
        model = json.loads(path.read_text()).get("model")
        if isinstance(model, str) and model:
            return (path.parent / model).resolve()
    return None


def start_openai_process(port: int, grpc_url: str, *flags: str) -> subprocess.Popen:
    """``python -m frontend.openai`` on 127.0.0.1:``port`` in front of ``grpc_url``, this checkout's code."""
    return subprocess.Popen([sys.executable, "-m", "frontend.openai", "--port", str(port), "--grpc-url", grpc_url,
                             *flags], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                           os.environ.get("PYTHONPATH")]))})


if __name__ == "__main__":
    main()


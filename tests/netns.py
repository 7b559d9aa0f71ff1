"""Hosts for tests: one Linux network namespace per host, joined to a switch, so that processes of different hosts
have separate network stacks (their own ``lo``, their own address, their own host identity:
``backend.protocol.handles.host_identity`` includes the network namespace) on one machine.

Layout of a ``Network({"a": "10.77.0.1", "b": "10.77.0.2"})``::

    namespace epdt<pid>n<k>-a          namespace epdt<pid>n<k>.sw            namespace epdt<pid>n<k>-b
      lo (up), eth0 10.77.0.1/24 ---veth--- v-a ]- br0 (bridge) -[ v-b ---veth--- eth0 10.77.0.2/24, lo (up)

Nothing is added to the namespace the caller runs in: the bridge lives in a switch namespace of its own, each veth pair
is created there with its host end moved straight into the host's namespace, so traffic between hosts stays inside
the namespaces this network made. Every host's interface is called ``eth0`` (``DEVICE``), which is the device to give
UCX there (``UCX_NET_DEVICES=eth0``; ``ucx_env``). Names carry the creating process's id and a per-process counter,
so parallel runs and several networks of one process never collide; the /24 is per namespace, so every network may
use the same addresses.

Who uses it: the e2e tests (``tests/e2e/netns_fixture.py``: the ``make_network`` fixture) and
``clients/bench/transfer_hosts.py``. Root only (``ip netns add``). No pytest in here.

What the methods mean for a test:
- ``popen(host, argv)``: a process in that host (``ip netns exec`` sets the namespace and execs: the PID returned is
  the process's own), in a session of its own, tracked;
- ``partition(host)`` / ``heal(host)``: the host's port on the switch down / up: packets to and from the host are
  dropped silently, both ways, as on a pulled cable (connects and sends time out; nothing is refused at once); the
  host keeps its address and routes, and talks to itself;
- ``executor(host)``: threads of this process that live in the host's namespace (``setns``), so that a test talks
  to the servers as a client on that host would (HTTP with urllib; not gRPC, whose core opens sockets on threads of
  its own);
- ``kill_host(host)``: SIGKILL, at once, every process in the host's namespace (whoever started it, children
  included): a host that dies. The namespace stays, so the host can be started again;
- ``close()`` (the context's exit, also when the body raised): every process of every host stopped (SIGTERM, then
  SIGKILL after ``grace`` seconds), every namespace deleted (their veths and the bridge go with them);
  ``leftovers()`` then names what is still there (nothing, or the exit raised ``NetnsError``).
"""
from __future__ import annotations

import ctypes
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

PREFIX = "epdt"          # every namespace of this harness starts with it (leftovers are recognisable)
DEVICE = "eth0"          # each host's interface to the switch, in its own namespace
SUBNET = "10.77.0.0/24"  # the hosts' subnet unless the caller gives another
NETNS_DIR = "/run/netns"  # where ``ip netns`` keeps its namespaces (bind mounts)
_HOST_NAME = re.compile(r"[a-z][a-z0-9_-]{0,12}$")  # "v-" + 13 characters: the switch port's name, <= 15
_OURS = re.compile(rf"{PREFIX}(\d+)n\d+[-.]")
_counter = itertools.count()
CLONE_NEWNET = 0x40000000


def enter_namespace(namespace: str) -> None:
    """Move the calling thread (only it) into the network namespace ``namespace`` (``ip netns``'s name)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


class NetnsError(RuntimeError):
    """A namespace, link or process of a ``Network`` could not be made, changed or removed (the message names it)."""


def ucx_env(device: str = DEVICE) -> dict[str, str]:
    """The UCX settings for a NIXL process in a host of a ``Network``: TCP only, on the host's interface.
    ``UCX_TLS=tcp`` because UCX decides "same machine" by boot id and IPC namespace, not by network namespace:
    left to itself it moves the data between our hosts by cross-memory attach or shared memory, which two
    real hosts cannot (docs/operations.md, "Hosts in network namespaces")."""
    return {"UCX_NET_DEVICES": device, "UCX_TLS": "tcp"}


_IP = shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str) -> str:
    """Run ``ip ARGS``; NetnsError with the command and ip's own message when it fails."""
    proc = subprocess.run([_IP, *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def namespaces() -> list[str]:
    """Every named network namespace on this machine (``ip netns list``)."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def pids_in(namespace: str) -> set[int]:
    """The processes whose network namespace is ``namespace`` (what ``ip netns pids`` prints), zombies excepted."""
    try:
        want = os.stat(os.path.join(NETNS_DIR, namespace))
    except FileNotFoundError:
        return set()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ns = os.stat(f"/proc/{entry}/ns/net")
            except OSError:  # gone meanwhile, a zombie, or a kernel thread
                continue
            if (ns.st_ino, ns.st_dev) == (want.st_ino, want.st_dev) and int(entry) != os.getpid():
                found.add(int(entry))
    return found


def orphans() -> list[str]:
    """Namespaces of this harness whose creating process is gone (a run that was killed before its teardown)."""
    return [name for name in namespaces() if (m := _OURS.match(name)) and not os.path.exists(f"/proc/{m.group(1)}")]


def remove_orphans() -> list[str]:
    """Kill what runs in ``orphans()`` and delete them; returns their names. Other runs' live networks are kept."""
    found = orphans()
    for name in found:
        _kill_all([name], signal.SIGKILL, deadline=time.monotonic() + 5)
        _ip("netns", "delete", name)
    return found


def _kill_all(spaces: Iterable[str], sig: int, deadline: float, groups: Iterable[int] = ()) -> set[int]:
    """Send ``sig`` to the process groups ``groups`` and to every process in ``spaces``, again until none is left
    or ``deadline`` passes (a process may fork meanwhile); returns the processes signalled."""
    spaces, signalled = list(spaces), set()
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    while True:
        alive = set().union(*(pids_in(ns) for ns in spaces)) if spaces else set()
        if not alive or sig != signal.SIGKILL and signalled >= alive:
            return signalled
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        signalled |= alive
        if time.monotonic() > deadline:
            return signalled
        time.sleep(0.01)


class Network:
    """Hosts ``{name: address}`` on one switch, each in its own network namespace (module docstring). Use it as a
    context manager; ``close`` may also be called directly (it is idempotent)."""

    def __init__(self, hosts: dict[str, str], subnet: str = SUBNET, grace: float = 3.0):
        self.subnet = ipaddress.ip_network(subnet)
        self.addresses = self._check(hosts)
        self.grace = grace
        self.tag = f"{PREFIX}{os.getpid()}n{next(_counter)}"
        self.switch = f"{self.tag}.sw"
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._made: list[str] = []  # namespaces created so far, in order

    def _check(self, hosts: dict[str, str]) -> dict[str, str]:
        if not hosts:
            raise ValueError("Network: no hosts given")
        seen: dict[ipaddress.IPv4Address | ipaddress.IPv6Address, str] = {}
        for name, address in hosts.items():
            if not isinstance(name, str) or not _HOST_NAME.match(name):
                raise ValueError(f"Network: host name {name!r} must match {_HOST_NAME.pattern} "
                                 "(it names a switch port, at most 15 characters with its 'v-')")
            ip = ipaddress.ip_address(address)
            if ip not in self.subnet or ip in (self.subnet.network_address, self.subnet.broadcast_address):
                raise ValueError(f"Network: host {name!r}: address {address} is no host address of {self.subnet}")
            if ip in seen:
                raise ValueError(f"Network: hosts {seen[ip]!r} and {name!r} both have address {address}")
            seen[ip] = name
        return dict(hosts)

    # -- names --------------------------------------------------------------------------------------
    @property
    def hosts(self) -> list[str]:
        return list(self.addresses)

    def namespace(self, host: str) -> str:
        if host not in self.addresses:
            raise KeyError(f"Network: no host {host!r} (hosts: {', '.join(self.addresses)})")
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        self.namespace(host)
        return self.addresses[host]

    def port(self, host: str) -> str:
        """The switch's end of ``host``'s veth (in the switch namespace)."""
        self.namespace(host)
        return f"v-{host}"

    # -- set-up and tear-down -----------------------------------------------------------------------
    def __enter__(self) -> "Network":
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except NetnsError as failed:
            if exc is None:
                raise
            exc.add_note(f"and the network's teardown failed: {failed}")  # the body's error stays the one raised

    def create(self) -> None:
        """The switch namespace with its bridge, then per host: the namespace, the veth pair, address, links up."""
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host, address in self.addresses.items():
            ns, port = self.namespace(host), self.port(host)
            self._add_namespace(ns)
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", DEVICE, "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", DEVICE)
            _ip("-n", ns, "link", "set", DEVICE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        for host in self.addresses:
            self._wait_carrier(host, True)

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        """Stop every process in every host (SIGTERM, SIGKILL after ``grace`` s), reap the ones started here, delete
        the namespaces (hosts, then the switch). NetnsError naming what is left if anything is."""
        spaces = [ns for ns in self._made if ns != self.switch]
        groups = [p.pid for _, p in self._procs if p.poll() is None]
        if _kill_all(spaces, signal.SIGTERM, time.monotonic(), groups):
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline and any(pids_in(ns) for ns in spaces):
                time.sleep(0.05)
        _kill_all(spaces, signal.SIGKILL, time.monotonic() + 10, [p.pid for _, p in self._procs if p.poll() is None])
        errors = self._reap()
        for ns in reversed(self._made):
            try:
                _ip("netns", "delete", ns)
            except NetnsError as exc:
                errors.append(str(exc))
        self._made = [ns for ns in self._made if ns in namespaces()]
        if left := self.leftovers():
            errors.append(f"namespaces still there: {', '.join(left)}")
        if errors:
            raise NetnsError("; ".join(errors))

    def _reap(self) -> list[str]:
        errors = []
        for host, proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                errors.append(f"process {proc.pid} of host {host!r} outlived SIGKILL")
        self._procs = [(h, p) for h, p in self._procs if p.returncode is None]
        return errors

    def leftovers(self) -> list[str]:
        """This network's namespaces still on the machine (empty after ``close``)."""
        return [ns for ns in namespaces() if ns == self.switch or ns.startswith(self.tag + "-")]

    # -- processes ----------------------------------------------------------------------------------
    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run in ``host`` (for callers that start the process themselves; ``kill_host`` and ``close``
        still reach it: they go by namespace)."""
        return [_IP, "netns", "exec", self.namespace(host), *argv]

    def popen(self, host: str, argv: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` in ``host``, in a session of its own (its process group is its PID), tracked for
        ``kill_host`` and ``close``. ``kwargs`` go to ``subprocess.Popen``."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(host, argv), env=env, **kwargs)
        self._procs.append((host, proc))
        return proc

    def launch(self, host: str, env: dict[str, str] | None = None, **defaults):
        """``launch(argv, **kwargs)``: ``popen`` in ``host`` with ``env`` and ``defaults`` (what
        ``devtools.diagnostics.pool_process`` takes to start its child somewhere)."""
        return lambda argv, **kwargs: self.popen(host, argv, env=env, **{**defaults, **kwargs})

    def executor(self, host: str, workers: int = 1) -> ThreadPoolExecutor:
        """A thread pool whose threads live in ``host``'s namespace (the caller shuts it down)."""
        return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"netns-{host}",
                                  initializer=enter_namespace, initargs=(self.namespace(host),))

    def pids(self, host: str) -> set[int]:
        """Every process running in ``host`` now."""
        return pids_in(self.namespace(host))

    def kill_host(self, host: str) -> set[int]:
        """SIGKILL every process in ``host`` at once (its sessions first, then whatever else is in the namespace) and
        reap those started here; returns the PIDs killed. The host's namespace and links stay."""
        ns = self.namespace(host)
        mine = [p for h, p in self._procs if h == host]
        before = pids_in(ns)
        groups = [p.pid for p in mine if p.poll() is None]
        killed = before | _kill_all([ns], signal.SIGKILL, time.monotonic() + 10, groups)
        for proc in mine:
            proc.wait(timeout=10)
        if left := pids_in(ns):
            raise NetnsError(f"host {host!r}: processes {sorted(left)} survived SIGKILL")
        return killed

    # -- links --------------------------------------------------------------------------------------
    def partition(self, host: str) -> None:
        """Cut ``host`` off the switch (its port down): its packets are dropped silently both ways."""
        _ip("-n", self.switch, "link", "set", self.port(host), "down")
        self._wait_carrier(host, False)

    def heal(self, host: str) -> None:
        """Put ``host`` back on the switch; returns once its interface has carrier again."""
        _ip("-n", self.switch, "link", "set", self.port(host), "up")
        self._wait_carrier(host, True)

    def link(self, host: str) -> dict:
        """``ip -j -s link show eth0`` in ``host``: state, flags and byte counters (``stats64``) of its interface."""
        (info,) = json.loads(_ip("-n", self.namespace(host), "-j", "-s", "link", "show", DEVICE))
        return info

    def _wait_carrier(self, host: str, up: bool, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while ("LOWER_UP" in self.link(host)["flags"]) != up:
            if time.monotonic() > deadline:
                raise NetnsError(f"host {host!r}: {DEVICE} {'has no' if up else 'still has'} carrier after {timeout} s")
            time.sleep(0.01)

"""The project's vLLM general plugin (entry point ``epd_patches`` of ``vllm.general_plugins``, pyproject.toml):
patches of vLLM, torch and NIXL internals, each on the versions it was checked on (``backend.protocol.versions``;
the list, with why and what each saves: docs/architecture.md, "Patches of vLLM, torch and NIXL internals").

vLLM calls ``register`` in each of its processes that loads plugins (an EngineCore forked from one inherits what
was patched there). Each patch is switched on by a variable, so other vLLM users are untouched:
``EPD_ENGINE_QUICK_EXIT=1``, ``EPD_ENGINE_FOLLOW_PARENT=1`` and ``EPD_GLOO_SHARED_DEVICE=1`` (all set for every stub
by ``backend.engine.host.PROCESS_ENV_DEFAULTS``): a stopped EngineCore skips the interpreter's teardown
(``patch_quick_exit``); an EngineCore whose parent is gone exits (``follow_parent``, no patch: a thread of its
own); gloo groups share one transport device (``share_gloo_device``); an EngineCore of a project host keeps its
gloo store's file in that host's private IPC directory (``keep_the_store_file_in_the_ipc_dir``: no variable, the
directory is the switch);
``EPD_ENGINE_NICE`` (an engine model's
``engine_nice``, topology ``engine_nice``): the EngineCore lowers its CPU priority to that niceness
(``lower_priority``; not a patch); ``EPD_ENGINE_IDLE_WAIT_MS`` (the ``prefill`` and ``decode`` models set it): the EngineCore's idle wait
(``patch_idle_wait``); ``EPD_NIXL_POLL_DELAY_US`` (``prefill`` and ``decode``): the poll delay of the NIXL
agents vLLM's NixlConnector creates (``backend.transfer.agent.patch_process_agents``); ``EPD_OMNI_AUDIO_EMBEDS=1``
(set for every stub): Qwen2.5-Omni's thinker takes precomputed audio embeddings (``backend.engine.omni_audio``). The memory diagnostic
(``EPD_ENGINE_MEMDEBUG``) is a plugin of its own in the developers' package (``devtools.diagnostics.memdebug``).
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import queue
import sys
import time
import uuid

from backend.engine.host import IPC_PREFIX
from backend.engine.leave import leave_now
from backend.engine.omni_audio import patch_omni_audio_embeds
from backend.protocol.versions import Guard
from backend.transfer.agent import POLL_DELAY_ENV, patch_process_agents

NICE_ENV = "EPD_ENGINE_NICE"  # an engine model's engine_nice: its EngineCore runs at that niceness (lower_priority)

# Checked on vLLM 0.32 (CPU) and 0.26.0 (GPU): EngineCoreProc._process_engine_step (its 1 ms sleep after a step
# that ran no model), _handle_client_request and input_queue are the same code; 0.27-0.31 were not looked at.
IDLE_WAIT = Guard("engine idle wait", "vllm", "0.26", "0.33",
                  "an EngineCore holding requests that only wait on the KV connector (prefill: finished requests "
                  "decode has not read) steps every 1 ms: ~1 ms more CPU per request in prefill's EngineCore at "
                  "c=16 (docs/results/epd.md)")
GLOO_DEVICE = Guard("shared gloo device", "torch", "2.11", "2.14",
                    "each gloo process group keeps a transport device of its own whose loop thread wakes every "
                    "10 ms: ~1,300 wake-ups a second, ~1.2% of a core per idle engine")
# Checked on vLLM 0.32 (CPU): EngineCoreProc.shutdown (run in run_engine_core's finally) and EngineShutdownState;
# 0.26 not looked at (outside the range: skipped, logged).
QUICK_EXIT = Guard("engine quick exit", "vllm", "0.32", "0.33",
                   "a stopped EngineCore spends ~2-3 s more tearing down its interpreter (2 cores), which every "
                   "model unload and server stop waits for")
# Checked on vLLM 0.32 (CPU): the uni-process executor names its store file with network_utils'
# get_file_store_init_method, imported by name; 0.26 not looked at.
STORE_FILE = Guard("engine store file", "vllm", "0.32", "0.33",
                   "an EngineCore that does not stop cleanly (killed at vLLM's 5 s grace, its host killed) leaves its "
                   "gloo store's file in /tmp: measured, 5 left by one fresh-clone CI run")


def patch_idle_wait(seconds: float) -> None:
    """EngineCore: after a step that ran no model while the scheduler still holds requests, wait up to
    ``seconds`` on the input queue (new requests and aborts wake it at once) before the next step.

    Such steps happen while requests only wait on the KV connector: in a KV producer (prefill), finished
    requests whose blocks decode has not read yet; in a consumer (decode), requests whose KV is still coming.
    vLLM sleeps 1 ms after each one and steps again (schedule, an empty model-runner pass that polls the
    connector, output update), which under load is a busy loop that costs CPU per request. The cost of the wait:
    a freed block or an arrived KV is noticed up to ``seconds`` later. Idempotent."""
    from vllm.v1.engine import core

    if not IDLE_WAIT.allows(core.EngineCoreProc, "_process_engine_step", "_handle_client_request"):
        return
    real = core.EngineCoreProc._process_engine_step
    if getattr(real, "epd_idle_wait", None) is not None:
        return

    def process_engine_step(self) -> bool:
        executed = real(self)
        if not executed and self.scheduler.has_requests():
            try:
                request = self.input_queue.get(timeout=seconds)
            except queue.Empty:
                pass
            else:
                self._handle_client_request(*request)
        return executed

    process_engine_step.epd_idle_wait = seconds
    core.EngineCoreProc._process_engine_step = process_engine_step


def patch_quick_exit() -> None:
    """An EngineCore process that was asked to stop (its shutdown state SHUTTING_DOWN: a SIGTERM or a shutdown
    request, not a failure) exits once its ``shutdown`` is done (connector, workers, distributed groups torn
    down): atexit handlers and multiprocessing's exit function run, the streams are flushed, then ``os._exit(0)``,
    without the interpreter's own teardown of the heap (torch, vLLM, the model). Measured on 2 cores, the tiny
    model's engine: ``EngineHost.shutdown`` 3.6-4.2 s -> 1.6 s. An engine whose busy loop never ends (a NIXL
    producer holding KV nobody reads) does not get here and is still killed by vLLM at its 5 s grace. An engine in
    the calling process (an in-process ``LLM``) is never touched; an engine that fails exits as vLLM makes it.
    Idempotent."""
    import multiprocessing

    from vllm.v1.engine import core

    if multiprocessing.parent_process() is None:  # not a spawned EngineCore
        return
    if not (QUICK_EXIT.allows(core, "EngineShutdownState")
            and QUICK_EXIT.allows(core.EngineCoreProc, "shutdown")):
        return
    real = core.EngineCoreProc.shutdown
    if getattr(real, "epd_quick_exit", False):
        return

    def shutdown(self) -> None:
        real(self)
        if getattr(self, "shutdown_state", None) == core.EngineShutdownState.SHUTTING_DOWN:
            _exit_now()

    shutdown.epd_quick_exit = True
    core.EngineCoreProc.shutdown = shutdown


def keep_the_store_file_in_the_ipc_dir() -> None:
    """The file of the distributed store vLLM makes for an EngineCore's groups goes into its host's private IPC
    directory (``VLLM_RPC_BASE_PATH``, set by ``backend.engine.host.private_ipc_dir`` and inherited by the
    EngineCore) instead of the temp directory: a clean stop removes it (the store's destructor), and whatever way the
    EngineCore ends, its host's release of that directory, or the next host's sweep of a killed host's, takes it
    with the directory. An EngineCore of another vLLM user (no such directory): untouched. Idempotent."""
    base = os.environ.get("VLLM_RPC_BASE_PATH", "")
    if not os.path.basename(base).startswith(IPC_PREFIX):
        return
    from vllm.utils import network_utils
    from vllm.v1.executor import uniproc_executor

    if not (STORE_FILE.allows(network_utils, "get_file_store_init_method")
            and STORE_FILE.allows(uniproc_executor, "get_file_store_init_method")):
        return

    def in_the_ipc_dir() -> str:
        return f"file://{base}/vllm_dist_{uuid.uuid4().hex}"

    network_utils.get_file_store_init_method = in_the_ipc_dir
    uniproc_executor.get_file_store_init_method = in_the_ipc_dir


def _exit_now() -> None:
    # forget_the_parent_s_exit cleared the handlers a forked EngineCore inherited: multiprocessing's and logging's
    # own exit functions are called here
    leave_now(0, f"epd quick exit: EngineCore pid {os.getpid()} stopped, leaving without the interpreter's teardown",
              multiprocessing.util._exit_function, logging.shutdown)


_FOLLOWING: list[int] = []  # the parent a thread of this process follows (follow_parent), once it runs


def follow_parent() -> None:
    """A spawned EngineCore exits (``os._exit(1)``) as soon as the process that started it, a Triton stub, is gone
    (as does a worker an EngineCore spawned, with more than one GPU: its parent is the EngineCore).

    vLLM stops its EngineCore from the parent (``AsyncLLM.shutdown``) and nothing in the EngineCore notices the
    parent's death: a stub that dies before that (killed, or ended by tritonserver at its exit timeout while its
    ``finalize`` hung) left an idle EngineCore running for good, with its memory (GPU memory on a GPU) and its
    multiprocessing resource tracker, which only unlinks the engine's ``/dev/shm/sem.mp-*`` once the engine is gone.
    Seen in CI (2026-12-03, tests/e2e/test_hosts.py): a pd stub hung at unload, tritonserver exited after 30 s, the
    stub ended, its EngineCore and tracker were still there 20 s later and were killed, the semaphore left behind.

    A daemon thread waits on multiprocessing's sentinel of the parent (its end of the pipe the EngineCore was
    started through: readable at the parent's exit, however it ended), so it costs no wake-ups; if the sentinel
    closes while the parent still lives, it watches ``os.getppid()`` instead, once a second. Not an EngineCore
    (no multiprocessing parent: a stub, an in-process ``LLM``): nothing. Idempotent."""
    import multiprocessing
    import threading

    parent = multiprocessing.parent_process()
    if parent is None or _FOLLOWING:
        return
    _FOLLOWING.append(parent.pid)
    threading.Thread(target=_exit_with, args=(parent.pid, parent.sentinel), name="epd-follow-parent",
                     daemon=True).start()


def _exit_with(pid: int, sentinel: int) -> None:
    from multiprocessing.connection import wait

    wait([sentinel])
    while os.getppid() == pid:  # the parent let go of the pipe but lives on
        time.sleep(1.0)
    import multiprocessing

    name = multiprocessing.current_process().name  # vLLM's: EngineCore, or a worker's
    print(f"epd: {name} pid {os.getpid()}: its parent, pid {pid}, is gone; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def share_gloo_device() -> None:
    """Gloo process groups made without options (what ``torch.distributed`` does for ``backend="gloo"``) use
    one transport device per process instead of a device each. A gloo device runs a loop thread that wakes
    every 10 ms even when idle; vLLM's CPU worker makes 13 groups, so an idle engine woke ~1,300 times a second
    (measured: ~1.2% of a core) for groups a single-process engine never sends on. Contexts sharing a device
    is how gloo is meant to be used (the device is the transport; each group keeps its own context and pairs).
    Idempotent."""
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "epd_shared_device", False):
        return
    if not GLOO_DEVICE.allows(base, "_Options", "create_default_device"):
        return
    shared: list = []

    class SharedDeviceGloo(base):
        epd_shared_device = True

        def __init__(self, store, rank, size, timeout=None):
            options = base._Options()
            if timeout is not None:
                options._timeout = timeout
            if not shared:
                shared.append(base.create_default_device())
            options._devices = [shared[0]]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


def lower_priority(nice: int) -> None:
    """This process's threads (Linux nice is per thread; threads made later inherit their maker's) at niceness
    ``nice`` (0-19), never raised above where they are."""
    for task in os.listdir("/proc/self/task"):
        try:
            tid = int(task)
            os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        except (OSError, ValueError):  # the thread ended meanwhile
            pass


def _as_engine_core() -> None:
    """What only an EngineCore (a multiprocessing child of the process hosting the engine) does."""
    nice = os.environ.get(NICE_ENV)
    if nice:
        lower_priority(int(nice))
    if os.environ.get("EPD_ENGINE_QUICK_EXIT") == "1":
        patch_quick_exit()
    if os.environ.get("EPD_ENGINE_FOLLOW_PARENT") == "1":
        follow_parent()
    keep_the_store_file_in_the_ipc_dir()


class _ForkedChildren:
    """multiprocessing's after-fork registry holds its objects weakly: this one lives as long as the module, and is
    registered once however often ``register`` runs."""
    registered = False

    @staticmethod
    def started(_) -> None:
        forget_the_parent_s_exit()
        _as_engine_core()


_FORKED_CHILDREN = _ForkedChildren()


def forget_the_parent_s_exit() -> None:
    """In a forked child: drop the exit handlers it inherited (``atexit``'s and ``weakref.finalize``'s), so that its
    exit (``_exit_now`` runs ``atexit``) cleans up what it made itself, as a spawned child's does, and never what its
    parent holds. Seen at every forked EngineCore's quick exit (2026-12-06): the parent's vLLM process manager's
    finalizer ran in the child and tried to stop the processes it lists, the child itself among them
    (``AttributeError: 'NoneType' object has no attribute 'terminate'``); the parent's other finalizers (vLLM's ZMQ
    sockets and contexts, temporary folders) would have run there too."""
    import atexit
    import weakref

    for inherited in list(getattr(weakref.finalize, "_registry", {})):
        inherited.detach()
    atexit._clear()
    weakref.finalize._registered_with_atexit = False  # a finalizer made here registers its atexit hook again


def register() -> None:
    if multiprocessing.parent_process() is not None:  # a spawned EngineCore: vLLM loads the plugins in it
        _as_engine_core()
    elif not _ForkedChildren.registered:  # a forked one inherits the loaded plugins (vLLM loads them once a
        # process): multiprocessing's after-fork hook runs in the child once it knows its parent, before its code
        _ForkedChildren.registered = True
        multiprocessing.util.register_after_fork(_FORKED_CHILDREN, _ForkedChildren.started)
    if os.environ.get("EPD_GLOO_SHARED_DEVICE") == "1":
        share_gloo_device()
    if os.environ.get("EPD_OMNI_AUDIO_EMBEDS") == "1":
        patch_omni_audio_embeds()
    wait = os.environ.get("EPD_ENGINE_IDLE_WAIT_MS")
    if wait:
        patch_idle_wait(float(wait) / 1000)
    value = os.environ.get(POLL_DELAY_ENV)
    if not value:
        return

    patch_process_agents(int(value))

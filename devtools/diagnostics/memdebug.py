"""Memory diagnostics inside a vLLM EngineCore process (opt-in, for soak investigations).

A vLLM general plugin of its own (entry point ``epd_memdebug``, pyproject.toml; the server's patches,
``backend.engine.patches``, know nothing of it): ``register`` starts it in each EngineCore process when
``EPD_ENGINE_MEMDEBUG`` names a directory. A daemon thread watches the engine; once it has been idle (no unfinished request) for a few
seconds after some work, it writes ``<dir>/<pid>-<n>.txt``: RSS, glibc's heap statistics, Python
objects by type, live torch tensors, the sizes of vLLM's per-request structures, and (with
``EPD_ENGINE_TRACEMALLOC=<frames>``) the top allocation sites by traceback compared with the previous
dump. ``EPD_ENGINE_MEMDEBUG_TRIM=1`` calls ``malloc_trim(0)`` after each dump and reports RSS after it.
"""
from __future__ import annotations

import collections
import ctypes
import gc
import os
import sys
import threading
import traceback
import time

from backend.protocol.versions import Guard

MEMDEBUG = Guard("engine memdebug", "vllm", "0.32", "0.33", "no memory reports from the EngineCore")
_started = False


def register() -> None:
    """vLLM calls this in each of its processes that loads plugins; off unless ``EPD_ENGINE_MEMDEBUG`` is set."""
    directory = os.environ.get("EPD_ENGINE_MEMDEBUG")
    if not directory:
        return
    from vllm.v1.engine import core  # heavy, and only needed where the diagnostic is on

    if MEMDEBUG.allows(core.EngineCore, "__init__"):
        install(directory)


def install(directory: str) -> None:
    """Start the watcher in every EngineCore this process creates (the EngineCore may be a fork of
    this process, where vLLM does not load plugins again), or now if this is one."""
    import multiprocessing

    if multiprocessing.current_process().name.startswith("EngineCore"):
        start(directory)
        return
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore.__init__, "_epd_memdebug", False):
        return
    original = EngineCore.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        start(directory, self)

    __init__._epd_memdebug = True
    EngineCore.__init__ = __init__


def start(directory: str, core=None) -> None:
    global _started
    if _started:
        return
    _started = True
    os.makedirs(directory, exist_ok=True)
    print(f"[memdebug] pid {os.getpid()}: watching the engine, reports in {directory}", file=sys.stderr, flush=True)
    threading.Thread(target=_watch, args=(directory, core), name="epd-memdebug", daemon=True).start()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    return libc


def _engine_core():
    """The EngineCore object, found as ``self`` in a frame of the busy loop."""
    for frame in sys._current_frames().values():
        while frame is not None:
            obj = frame.f_locals.get("self")
            if obj is not None and any(cls.__name__ == "EngineCore" for cls in type(obj).__mro__):
                return obj
            frame = frame.f_back
    return None


def _sizes(core) -> dict[str, int]:
    out = {}
    if core is None:
        return out
    sched = core.scheduler
    out["scheduler.requests"] = len(sched.requests)
    out["scheduler.finished_req_ids"] = len(getattr(sched, "finished_req_ids", ()))
    ecm = getattr(sched, "encoder_cache_manager", None)
    if ecm is not None:
        out["encoder_cache_manager.cached"] = len(getattr(ecm, "cached", ()))
        out["encoder_cache_manager.freeable"] = len(getattr(ecm, "freeable", ()))
        out["encoder_cache_manager.freed"] = len(getattr(ecm, "freed", ()))
    try:
        runner = core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        runner = None
    if runner is not None:
        out["runner.requests"] = len(runner.requests)
        out["runner.encoder_cache"] = len(runner.encoder_cache)
        out["runner.encoder_cache_bytes"] = sum(t.numel() * t.element_size() for t in runner.encoder_cache.values()
                                                if hasattr(t, "numel"))
    cache = getattr(core, "mm_receiver_cache", None)
    if cache is not None:
        out["mm_receiver_cache"] = repr(type(cache))
    return out


def _describe(obj) -> str:
    name = type(obj).__qualname__
    if isinstance(obj, dict):
        keys = list(obj)[:4]
        return f"dict(len={len(obj)}, keys={keys!r:.120})"
    if isinstance(obj, (list, tuple, set)):
        return f"{name}(len={len(obj)})"
    return name


def _referrer_chain(obj, depth: int = 6) -> list[str]:
    """Who keeps ``obj`` alive: referrers, breadth-first, a few per level (frames and this function's lists
    skipped; the caller's list of samples shows up as one)."""
    import types

    lines = [f"referrers of {_describe(obj)}:"]
    level, seen = [obj], {id(obj)}
    for d in range(depth):
        following = []
        for item in level:
            for ref in gc.get_referrers(item):
                if isinstance(ref, types.FrameType) or id(ref) in seen or ref is level or ref is following:
                    continue
                if isinstance(ref, list) and len(ref) > 10000:
                    continue
                seen.add(id(ref))
                following.append(ref)
                lines.append(f"  {'  ' * d}<- {_describe(ref)}")
                if len(following) >= 4:
                    break
        level = following
        if not level:
            break
    return lines


def _dump(directory: str, n: int, previous, libc, core) -> object:
    lines = [f"dump {n} at {time.strftime('%H:%M:%S')} pid {os.getpid()}"]
    gc.collect()
    lines.append(f"rss_mib {_rss_mib():.1f}")
    info = libc.mallinfo2()
    lines.append("mallinfo2 " + " ".join(f"{k}={getattr(info, k) / 2**20:.1f}M" if k not in ("ordblks", "smblks", "hblks")
                                         else f"{k}={getattr(info, k)}" for k, _ in _Mallinfo2._fields_))
    for key, value in _sizes(core).items():
        lines.append(f"size {key} {value}")
    import torch
    counts: collections.Counter = collections.Counter()
    tensors: collections.Counter = collections.Counter()
    tensor_bytes: collections.Counter = collections.Counter()
    target = os.environ.get("EPD_ENGINE_MEMDEBUG_REFERRERS", "MultiModalKwargsItem")
    samples = []  # a few objects of the target type, whose referrers are listed
    for obj in gc.get_objects():
        counts[type(obj).__qualname__] += 1
        if len(samples) < 3 and type(obj).__name__ == target:
            samples.append(obj)
        if isinstance(obj, torch.Tensor):
            try:
                key = (str(obj.dtype), obj.dim(), obj.device.type)
                tensors[key] += 1
                tensor_bytes[key] += obj.untyped_storage().nbytes()
            except Exception:
                pass
    lines.append(f"gc objects {sum(counts.values())}")
    for sample in samples:
        lines.extend(_referrer_chain(sample))
    del samples
    for name, count in counts.most_common(40):
        lines.append(f"type {count} {name}")
    for key, count in tensors.most_common(20):
        lines.append(f"tensor {count} {tensor_bytes[key] / 2**20:.2f}MiB {key}")
    snapshot = None
    import tracemalloc
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        total = sum(stat.size for stat in snapshot.statistics("filename"))
        lines.append(f"tracemalloc total {total / 2**20:.1f} MiB")
        stats = snapshot.compare_to(previous, "traceback") if previous is not None else snapshot.statistics("traceback")
        for stat in stats[:25]:
            lines.append(f"--- {stat}")
            for frame in stat.traceback.format()[-12:]:
                lines.append("    " + frame)
    if os.environ.get("EPD_ENGINE_MEMDEBUG_TRIM") == "1":
        libc.malloc_trim(0)
        lines.append(f"rss_mib_after_trim {_rss_mib():.1f}")
    with open(os.path.join(directory, f"{os.getpid()}-{n}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    frames = int(os.environ.get("EPD_ENGINE_TRACEMALLOC", "0") or 0)
    if frames and not tracemalloc.is_tracing():  # from the first dump on (after the warm-up)
        tracemalloc.start(frames)
    return snapshot if snapshot is not None else previous


def _watch(directory: str, core) -> None:
    try:
        _watch_loop(directory, core)
    except BaseException:
        traceback.print_exc()


def _watch_loop(directory: str, core) -> None:
    libc = _libc()
    previous, n, idle, cpu_at_dump = None, 0, 0, 0.0
    while core is None:
        time.sleep(5)
        core = _engine_core()
    while True:
        time.sleep(1)
        busy = core.scheduler.get_num_unfinished_requests() > 0
        idle = 0 if busy else idle + 1
        cpu = time.process_time()
        if idle >= 4 and cpu - cpu_at_dump > 2.0:
            previous = _dump(directory, n, previous, libc, core)
            n += 1
            cpu_at_dump = time.process_time()

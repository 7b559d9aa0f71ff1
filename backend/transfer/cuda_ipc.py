"""Same-host GPU handoff through CUDA IPC: the producer's VRAM pool, opened by consumers on the same host.

Why: NIXL with UCX's defaults moves VRAM between two processes on one GPU through ``cuda_copy`` at
0.35-0.55 GB/s (measured on an H200, ``docs/results/gpu.md``), while a CUDA IPC mapping lets the consumer copy
device-to-device at the GPU's copy bandwidth (~2 TB/s). NIXL stays the path across hosts and the channel
for release notifications on every path.

- ``DeviceAllocation``: the producer's pool, one ``cudaMalloc`` (IPC handles name a whole allocation, so
  the pool is not taken from torch's caching allocator), viewed as a torch ``uint8`` tensor; ``ipc_handle``
  is its ``cudaIpcMemHandle_t`` as hex, carried in each lease's ``TransferHandle``.
- ``open_allocation``: a consumer's mapping of it (``cudaIpcOpenMemHandle``), opened once per producer
  pool and process (shared by reference) and closed when the last user lets go (producer forgotten or gone).

Needs ``cuda-bindings`` (NVIDIA's CUDA Python bindings) and a CUDA device; ``available()`` says whether
this process has both. Where it has not, producers publish without a handle and consumers use NIXL.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import torch


@functools.lru_cache(maxsize=1)
def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import runtime  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _rt():
    from cuda.bindings import runtime
    return runtime


def _check(result, what: str):
    err, *value = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return value[0] if len(value) == 1 else value


class _DevicePointer:
    """A raw device pointer as a ``__cuda_array_interface__`` object, so torch can view it."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner  # keeps the allocation or mapping alive as long as a torch view exists
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class DeviceAllocation:
    def __init__(self, nbytes: int, device: torch.device):
        rt = _rt()
        self.device = torch.device(device.type, device.index or 0)
        with torch.cuda.device(self.device):
            self.ptr = int(_check(rt.cudaMalloc(nbytes), "cudaMalloc"))
            _check(rt.cudaMemset(self.ptr, 0, nbytes), "cudaMemset")
            handle = _check(rt.cudaIpcGetMemHandle(self.ptr), "cudaIpcGetMemHandle")
        self.nbytes = nbytes
        self.ipc_handle = bytes(handle.reserved).hex()
        self.tensor = torch.as_tensor(_DevicePointer(self.ptr, nbytes, self), device=self.device)

    def close(self) -> None:
        """Free the allocation. Every torch view of it must be gone; consumers' mappings keep the memory
        (the driver frees it when the last one closes)."""
        if self.ptr:
            self.tensor = None
            with torch.cuda.device(self.device):
                torch.cuda.synchronize(self.device)
                _check(_rt().cudaFree(self.ptr), "cudaFree")
            self.ptr = 0


_opened: dict[tuple[str, int], list] = {}  # (handle, device index) -> [OpenedAllocation, users]
_opened_lock = threading.Lock()


def open_allocation(ipc_handle: str, nbytes: int, device: torch.device) -> "OpenedAllocation":
    """This process's one mapping of a producer's pool (a handle can be opened once per process);
    each caller closes its own reference with ``close()``."""
    index = device.index or 0 if device.type == "cuda" else 0
    with _opened_lock:
        entry = _opened.get((ipc_handle, index))
        if entry is None:
            entry = _opened[(ipc_handle, index)] = [OpenedAllocation(ipc_handle, nbytes, device), 0]
        entry[1] += 1
        return _Reference(entry[0], (ipc_handle, index))


class _Reference:
    def __init__(self, opened: "OpenedAllocation", key):
        self.opened, self.key, self.tensor = opened, key, opened.tensor

    def close(self) -> None:
        if self.opened is None:
            return
        self.tensor = None
        with _opened_lock:
            entry = _opened[self.key]
            entry[1] -= 1
            if entry[1] == 0:
                _opened.pop(self.key)
                entry[0].close()
        self.opened = None


class OpenedAllocation:
    def __init__(self, ipc_handle: str, nbytes: int, device: torch.device):
        rt = _rt()
        handle = rt.cudaIpcMemHandle_t()
        handle.reserved = bytes.fromhex(ipc_handle)
        self.device = torch.device("cuda", device.index or 0) if device.type == "cuda" else torch.device("cuda", 0)
        with torch.cuda.device(self.device):
            self.ptr = int(_check(rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess),
                                  "cudaIpcOpenMemHandle"))
        self.tensor = torch.as_tensor(_DevicePointer(self.ptr, nbytes, self), device=self.device)

    def close(self) -> None:
        if self.ptr:
            self.tensor = None
            with torch.cuda.device(self.device):
                torch.cuda.synchronize(self.device)
                _check(_rt().cudaIpcCloseMemHandle(self.ptr), "cudaIpcCloseMemHandle")
            self.ptr = 0



def enqueue_region(src_ptr: int, dst_ptr: int, nbytes: int, tag_ptr: int | None, stream: int,
                   to_host: bool = False) -> None:
    """One pull's copies on ``stream`` (no wait): ``nbytes`` from the VRAM at ``src_ptr`` to ``dst_ptr`` (VRAM,
    or pinned host memory if ``to_host``), then, if ``tag_ptr`` is given, the 8-byte lease tag right after
    them (the region's trailer) into the pinned host word at ``tag_ptr``. The direction is given, not
    inferred (``cudaMemcpyDefault`` makes the runtime look both pointers up: measured ~9 us a call here)."""
    memcpy, _ = _hot_calls()
    memcpy(dst_ptr, src_ptr, nbytes, _TO_HOST if to_host else _TO_DEVICE, stream)
    if tag_ptr is not None:
        memcpy(tag_ptr, src_ptr + nbytes, 8, _TO_HOST, stream)


def synchronize(stream: int) -> None:
    _hot_calls()[1](stream)


_TO_HOST, _TO_DEVICE = 2, 3  # cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice


@functools.lru_cache(maxsize=1)
def _hot_calls():
    """(memcpy_async, stream_synchronize) for the per-pull calls: the CUDA runtime library torch loaded,
    called through ctypes (~1 us a call; a torch ``copy_`` costs more host time than a 16 MiB
    device-to-device copy takes, cuda-bindings' wrappers a few us: docs/results/gpu.md), or cuda-bindings where
    that library cannot be found in this process."""
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "/libcudart.so" in line), None)
    if path is None:
        rt = _rt()
        return (lambda *args: _check(rt.cudaMemcpyAsync(*args), "cudaMemcpyAsync"),
                lambda stream: _check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize"))
    lib = ctypes.CDLL(path)
    memcpy_async, stream_sync = lib.cudaMemcpyAsync, lib.cudaStreamSynchronize
    memcpy_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    stream_sync.argtypes = [ctypes.c_void_p]
    memcpy_async.restype = stream_sync.restype = ctypes.c_int

    def memcpy(dst, src, nbytes, kind, stream):
        if err := memcpy_async(dst, src, nbytes, kind, stream):
            raise RuntimeError(f"cudaMemcpyAsync failed: CUDA error {err}")

    def sync(stream):
        if err := stream_sync(stream):
            raise RuntimeError(f"cudaStreamSynchronize failed: CUDA error {err}")

    return memcpy, sync

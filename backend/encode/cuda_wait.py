"""How a process's CPU threads wait for its GPU: spinning (CUDA's default for a process with fewer busy threads than
cores) or sleeping on an OS primitive (``CU_CTX_SCHED_BLOCKING_SYNC``).

Why it was tried: a GPU encoder waits for its tower once per item it publishes (``EmbeddingPool.publish``
synchronizes before the bytes can be read), and with Qwen2-VL-2B's tower its process spends ~27 ms of CPU per 896 px
image beyond ~3 ms of preprocessing, about the batch's wall time. Measured on the H200 (2026-12-04, docs/gpu.md):
sleeping waits changed nothing (30.4 -> 30.2 ms per image; served, the encoder's CPU per request 264-274 -> 272-296
ms): that CPU is not the waits' spinning. Kept as an encoder setting (``cuda_blocking_sync``) no topology renders.

``block_on_waits(index)`` must run before the process creates its CUDA context on that device (before the first
CUDA tensor); it uses the driver API through ctypes (``libcuda.so.1``), so it needs no CUDA toolkit.
"""
from __future__ import annotations

import ctypes

CU_CTX_SCHED_BLOCKING_SYNC = 0x4


def block_on_waits(index: int = 0) -> bool:
    """Make this process's waits on GPU ``index`` (device, stream and event synchronizations, blocking copies) sleep
    instead of spin: the primary context's scheduling flag, set before the context exists. False where it could
    not be set (no driver; the context already active with other flags), and nothing changed."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    device = ctypes.c_int()
    if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), int(index)) != 0:
        return False
    if driver.cuDevicePrimaryCtxSetFlags(device, CU_CTX_SCHED_BLOCKING_SYNC) != 0:
        return False
    flags, active = ctypes.c_uint(), ctypes.c_int()
    if driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) != 0:
        return False
    return bool(flags.value & CU_CTX_SCHED_BLOCKING_SYNC)


__all__ = ["CU_CTX_SCHED_BLOCKING_SYNC", "block_on_waits"]

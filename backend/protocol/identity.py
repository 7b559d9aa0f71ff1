"""What identifies an encoded item (``content_key``: its bytes, processing options and model) and a host
(``host_identity``: where a transfer handle's producer runs), the two identities a layout document carries
(``backend.protocol.layout``, which re-exports both).
"""
from __future__ import annotations


def host_identity() -> str:
    """This host as seen by a peer: the kernel boot id and the network namespace. Processes in other
    network namespaces count as other hosts (that is how tests model a second machine)."""
    import os

    with open("/proc/sys/kernel/random/boot_id") as fh:
        boot = fh.read().strip()
    return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"


def content_key(data: bytes, processing: str, model: str, part: tuple[int, int] | None = None) -> str:
    """The identity of one encoded item: its bytes, the processing options applied to it, and the model
    (the same picture through another processor config or model is another item); ``part``: ``(i, n)`` for part i
    of n of a video (``backend.protocol.generate.PART_PARAMETER``), a key of its own, never the whole item's."""
    import hashlib

    h = hashlib.sha256()
    for piece in (model.encode(), b"\x00", processing.encode(), b"\x00", data):
        h.update(piece)
    if part is not None:
        h.update(f"\x00part {part[0]}/{part[1]}".encode())
    return h.hexdigest()[:32]

"""A lease's region in a producer's pool, as every transport reads it: ``[tag u64 | nbytes u64 | payload | tag u64]``
(``backend.transfer.producer`` writes it; the tag is the lease id, zeroed when the lease ends), and the notification
a consumer sends when it has the bytes (``release:<lease_id>[,<lease_id>...]``)."""
from __future__ import annotations

HEADER = 16
TRAILER = 8
ALIGN = 64
RELEASE_PREFIX = b"release:"

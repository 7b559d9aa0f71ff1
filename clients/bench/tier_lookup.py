"""What one lookup in the shared embedding tier costs, seen from a store client like an encoder instance's (the reuse
benchmark's part (d), ``clients.bench.reuse``): a miss and a hit through ``EmbeddingTier.get`` (the store's ``get``,
then for a hit the entry's header, contract and integrity checks), ``is_exist`` alone, and a single-flight claim of
a cold item.

    python -m clients.bench.tier_lookup MASTER METADATA SITE_PACKAGES CHECKPOINT [N]

Run it in a process with Mooncake's libraries on ``LD_LIBRARY_PATH`` (``backend.deploy.tier_service.TierRun.env``).
It writes N entries of its own (the size of one 224x224 image's embeddings, keys no request can have), times N
lookups of each kind, removes its entries and prints ``LOOKUP {json}`` (milliseconds: p50, p90).
"""
from __future__ import annotations

import json
import sys
import time
import uuid

GRID = (1, 16, 16)  # a 224x224 image: 16x16 patches, 64 tokens after the 2x2 merge


def _timed(fn, keys: list[str]) -> dict[str, float]:
    from clients.bench.report import percentile

    took = []
    for key in keys:
        started = time.perf_counter()
        fn(key)
        took.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": round(percentile(took, 50), 3), "p90_ms": round(percentile(took, 90), 3), "n": len(took)}


def measure(tier, expect, n: int) -> dict:
    """Timings of ``n`` lookups each: misses, hits (entries written first), ``is_exist``, claims of cold keys."""
    import torch

    from backend.encode.encoder import EncodedItem
    from backend.encode.tier import CLAIM_PREFIX

    run = uuid.uuid4().hex
    written = [f"reuse-bench:{run}:{i}" for i in range(n)]
    item = EncodedItem(torch.randn(GRID[1] * GRID[2] // 4, expect.width), GRID)
    for i, key in enumerate(written):
        tier.put(key, item, expect)
        if i % 32 == 31:  # the writer's queue holds 64: a full one drops writes
            tier.flush()
    tier.flush()
    out = {"entry_bytes": item.embeddings.numel() * item.embeddings.element_size(),
           "miss": _timed(lambda k: tier.get(k, expect), [f"reuse-bench:{run}:missing:{i}" for i in range(n)]),
           "hit": _timed(lambda k: tier.get(k, expect), written),
           "exists": _timed(tier.store.exists, written),
           "claim": _timed(tier.claim, [f"reuse-bench:{run}:cold:{i}" for i in range(n)])}
    out["hits_served"] = tier.stats.hits  # every written entry read back: else the "hit" timings include misses
    if tier.stats.hits != n or tier.stats.dropped_writes:
        raise RuntimeError(f"{tier.stats.hits} of {n} entries read back ({tier.stats.dropped_writes} writes dropped)")
    for key in written + [f"{CLAIM_PREFIX}reuse-bench:{run}:cold:{i}" for i in range(n)]:
        tier.store.remove(key)
    return out


def main(argv: list[str] | None = None) -> None:
    master, metadata, site, checkpoint, *rest = argv if argv is not None else sys.argv[1:]
    from backend.encode.checkpoint import embedding_width, model_identity, processing_options
    from backend.encode.tier import TierExpect
    from backend.encode.tier_mooncake import connect

    tier = connect(master, metadata, site_packages=site)
    try:
        expect = TierExpect(model_identity(checkpoint), processing_options(checkpoint), "float32",
                            embedding_width(checkpoint))
        print("LOOKUP " + json.dumps(measure(tier, expect, int(rest[0]) if rest else 50)), flush=True)
    finally:
        tier.close()


if __name__ == "__main__":
    main()

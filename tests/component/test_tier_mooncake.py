"""The shared embedding tier on a real Mooncake Store: the test starts ``mooncake_master`` and the ``mooncake_client``
holding the budget on free 127.0.0.1 ports (``backend.deploy.tier_service``), and stops them; the tier's clients run
in processes of their own (the dynamic loader needs Mooncake's private libibverbs on ``LD_LIBRARY_PATH`` at start).

Skipped, saying why, where Mooncake is not installed: ``.venv-mooncake`` (scripts/setup_mooncake.sh), or
``EPD_MOONCAKE_VENV`` naming its venv and ``EPD_MOONCAKE_LIBS`` its libibverbs/libnl directories (docs/tier.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend.deploy.tier_service import LIBS_ENV, VENV_ENV, library_env, mooncake_paths, start_tier, stop_tier

pytestmark = pytest.mark.component

WORKER = '''
import json, sys, time, hashlib
import torch
from backend.encode.encoder import EncodedItem
from backend.encode.tier import EmbeddingTier, TierExpect, encode_entry
from backend.encode.tier_mooncake import MooncakeStore
master, metadata, command = sys.argv[1], sys.argv[2], sys.argv[3]
expect = TierExpect("qwen2_vl:abc", "{}", "float32", 64)
store = MooncakeStore(master, metadata)
# claims live 120 s: the four claimants may start seconds apart on a loaded machine
tier = EmbeddingTier(store, call_timeout=float(sys.argv[4]) if len(sys.argv) > 4 else 1.0, claim_seconds=120)
item = EncodedItem(torch.randn(256, 64, generator=torch.Generator().manual_seed(7)), (1, 32, 32))
out = {}
if command == "put":
    tier.put("item", item, expect)
    blob = encode_entry("bad", item, expect)
    store.put_bytes("bad", blob[:-1] + bytes([blob[-1] ^ 1]))  # a corrupted entry, planted
    tier.flush()
elif command == "get":
    got = tier.get("item", expect)
    out["equal"] = got is not None and torch.equal(got.embeddings, item.embeddings)
    out["other_model"] = tier.get("item", TierExpect("qwen2_vl:other", "{}", "float32", 64)) is not None
    out["bad"] = tier.get("bad", expect) is not None
    out["bad_gone"] = not store.exists("bad")
    out["bad_counts"] = tier.stats.bad
elif command == "claim":
    out["won"] = tier.claim("new item")
elif command == "down":
    print("READY", flush=True)
    sys.stdin.readline()  # the master is killed meanwhile
    started = time.perf_counter()
    out["get"] = tier.get("item", expect) is not None
    out["claim"] = tier.claim("x")
    out["seconds"] = time.perf_counter() - started
    out["errors"] = tier.stats.errors
print("RESULT " + json.dumps(out), flush=True)
tier.close()
'''


@pytest.fixture(scope="module")
def tier_service(tmp_path_factory):
    paths = mooncake_paths()
    if paths is None:
        pytest.skip(f"Mooncake is not installed: set {VENV_ENV} (a venv with mooncake-transfer-engine-non-cuda) and "
                    f"{LIBS_ENV} (its libibverbs/libnl directories), docs/tier.md")
    probe = subprocess.run([sys.executable, "-c", "from backend.encode.tier_mooncake import import_store_class as i; i()"],
                           env=client_env(paths[2]), capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"mooncake is not importable here: {probe.stderr.strip().splitlines()[-1:]}")
    master, holder = start_tier(64 << 20, log_dir=str(tmp_path_factory.mktemp("mooncake")))
    yield master, holder
    stop_tier(master, holder)


def client_env(libs: str) -> dict:
    """A tier client process's environment: Mooncake's libraries on ``LD_LIBRARY_PATH``, its venv named."""
    return {**library_env(libs), VENV_ENV: str(mooncake_paths()[0].parents[2])}


def _client(master, command: str, *extra: str, timeout: float = 120) -> dict:
    config = master.client_config()
    done = subprocess.run([sys.executable, "-c", WORKER, config["rpc"], config["metadata"], command, *extra],
                          env=client_env(master.libs), capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_an_entry_one_process_wrote_is_read_by_another_and_a_bad_one_is_dropped(tier_service):
    master, _ = tier_service
    _client(master, "put")  # that process exits: the holder keeps its entries
    got = _client(master, "get")
    assert got == {"equal": True, "other_model": False, "bad": False, "bad_gone": True,
                   "bad_counts": {"integrity": 1, "model": 1}}


def test_concurrent_claims_from_four_processes_have_one_winner(tier_service):
    master, _ = tier_service
    with ThreadPoolExecutor(4) as pool:
        won = [r["won"] for r in pool.map(lambda _: _client(master, "claim"), range(4))]
    assert sorted(won) == [False, False, False, True]


def test_a_dead_master_costs_one_call_timeout_and_fails_nothing(tier_service):
    """The client is connected when the master dies (SIGKILL); Mooncake's own calls then take ~4.3 s each and fail
    with RPC_FAIL (docs/tier.md): the tier gives up after ``call_timeout`` once and skips the store after that."""
    master, _ = tier_service
    config = master.client_config()
    client = subprocess.Popen([sys.executable, "-c", WORKER, config["rpc"], config["metadata"], "down", "0.5"],
                              env=client_env(master.libs), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        assert client.stdout.readline().strip() == "READY"
        master.kill()
        client.stdin.write("go\n")
        client.stdin.flush()
        out, _ = client.communicate(timeout=180)
    finally:
        client.kill()
        master.start()  # so that the fixture stops a live one
    got = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert got["get"] is False and got["claim"] is True and got["errors"] == 1 and got["seconds"] < 2.0

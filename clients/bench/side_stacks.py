"""The stacks ``clients.bench.side_by_side`` compares: vLLM's own (OpenAI API servers, its connectors, its example EPD
proxy) and this project's (tritonserver on a rendered topology + ``frontend.openai``), started and stopped here.

Engine settings: every engine on both sides gets the rendered ``model.json`` of the topology's stage
(``backend.deploy.render.render_engine_args``: max_num_seqs, max_model_len, kv_cache_memory_bytes, dtype,
enforce_eager, seed, limit_mm_per_prompt, ...); the engines fed metadata-only items (vLLM's and ours: pd, prefill,
decode) get them through ``backend.engine.host.metadata_only_engine_args`` as ours do (enable_mm_embeds, no processor
cache). vLLM's processes run with ``VLLM_ENV`` (what ``backend.engine.host.PROCESS_ENV_DEFAULTS`` gives ours, less the
project's own patches: ``VLLM_PLUGINS`` is empty), except that the prefill and decode of ``vllm-e-p-d-delay`` load the
project's plugin with only ``EPD_NIXL_POLL_DELAY_US`` set, which sets NIXL's progress-thread poll delay in the agents
vLLM's NixlConnector creates (``backend.transfer.agent.patch_process_agents``), the way docs/RECIPES measured it.

vLLM's stacks (``vllm_stack``): ``vllm-single`` (one API server), ``vllm-e-pd`` (an ``ec_producer`` encoder and an
``ec_consumer`` P/D server sharing an ``ECExampleConnector`` directory, behind the proxy with prefill disabled),
``vllm-e-p-d`` (encoder, ``ec_consumer`` + NixlConnector ``kv_producer`` prefill, ``kv_consumer`` decode, UCX on
loopback, behind the proxy) and ``vllm-e-p-d-delay`` (the same with the poll delay). ``running(servers, ...)`` starts
them one after the other, each in a session of its own, waits for each one's ``/health``, and stops every process
group it started (SIGTERM, then SIGKILL) on exit.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from backend.deploy.local_server import ROOT

VLLM_STACKS = ("vllm-single", "vllm-e-pd", "vllm-e-p-d", "vllm-e-p-d-delay")
OURS = {"llm": "baseline", "epd": "E+PD", "epd_disagg": "E/P/D"}  # our row -> the topology's deployment
SERVED_NAME = "vllm"  # the model name vLLM's servers answer to
VLLM_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "UCX_NET_DEVICES": "lo", "VLLM_PLUGINS": "",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "LC_ALL": "C.UTF-8"}
PLUGIN = "epd_patches"  # pyproject.toml's vllm.general_plugins entry point
POLL_DELAY_ENV = "EPD_NIXL_POLL_DELAY_US"  # backend.transfer.agent.POLL_DELAY_ENV (not imported: no NIXL import here)


@dataclass(frozen=True)
class Server:
    """One process of a stack: its CPU group name, command, extra environment, and the port its /health is on."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)


def engine_settings(topology, mode: str, stage: str) -> dict:
    """The engine arguments ``topology`` gives ``stage`` when it serves ``mode`` alone (its rendered model.json,
    less the note and the model path)."""
    from backend.deploy.render import GENERATED_KEY, render_engine_args

    served = topology.only(mode)
    args = json.loads(render_engine_args(served, stage, ROOT))
    return {k: v for k, v in args.items() if k not in (GENERATED_KEY, "model")}


def engine_flags(args: dict) -> list[str]:
    """vLLM CLI flags for engine arguments: ``True`` -> ``--flag``, ``False`` -> ``--no-flag``, dicts as JSON."""
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


def buffer_device(topology, stage: str) -> str:
    """Where a connector of ``stage``'s engine keeps its buffers: ``cuda`` where the topology puts that stage on a
    GPU (as ours: ``backend.engine.host.kv_transfer_config``), else ``cpu``."""
    spec = topology.stages.get(stage)
    return "cuda" if spec is not None and spec.device == "gpu" else "cpu"


def ec_config(role: str, directory: Path, device: str = "cpu") -> str:
    """``--ec-transfer-config`` of an ``ec_producer`` or ``ec_consumer`` sharing ``directory`` (ECExampleConnector,
    which keeps each item's embeddings as a safetensors file there)."""
    return json.dumps({"ec_connector": "ECExampleConnector", "ec_role": role, "ec_buffer_device": device,
                       "ec_connector_extra_config": {"shared_storage_path": str(directory)}})


# an ec_producer runs without prefix caching, as vLLM's own EPD examples start their encoders: vLLM 0.26's encoder
# server on the H200 otherwise fails at start ("HybridKVCacheCoordinator requires at least two attention groups",
# 2026-12-05; vLLM 0.32 on the CPU started either way)
ENCODER_FLAGS = ("--no-enable-prefix-caching",)


def encoder_settings(settings: dict) -> dict:
    """An ec_producer's engine settings: eager always. Its work is the vision tower, which vLLM runs eager either way;
    compiled (``--compile``), vLLM 0.26's encoder server fails at start while capturing the language model it never
    runs (``KeyError: 'language_model.model.layers.0.self_attn.attn'`` in ``unified_kv_cache_update``, H100
    2026-12-06)."""
    return {**settings, "enforce_eager": True}


def kv_config(role: str, device: str = "cpu") -> str:
    """``--kv-transfer-config`` of a NixlConnector ``kv_producer`` or ``kv_consumer``, its buffers in host memory
    (``cpu``) or in VRAM (``cuda``)."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": device})


def api_server_argv(checkpoint: Path, port: int, settings: dict, *extra: str) -> list[str]:
    """vLLM's OpenAI API server (what ``vllm serve`` runs) of ``checkpoint`` on 127.0.0.1:``port``."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            *engine_flags(settings), *extra]


def proxy_argv(proxy: Path, port: int, encoders: list[int], prefill: int | None, decode: int) -> list[str]:
    """vLLM's example EPD proxy on 127.0.0.1:``port`` in front of the servers on those ports (no prefill: E+PD)."""
    urls = lambda ports: ",".join(f"http://127.0.0.1:{p}" for p in ports)  # noqa: E731
    return [sys.executable, str(proxy), "--host", "127.0.0.1", "--port", str(port), "--encode-servers-urls",
            urls(encoders), "--prefill-servers-urls", "disable" if prefill is None else urls([prefill]),
            "--decode-servers-urls", urls([decode])]


def vllm_stack(kind: str, topology, proxy: Path, ports: list[int], ec_dir: Path, poll_delay_us: int) -> list[Server]:
    """The servers of vLLM's stack ``kind`` (``VLLM_STACKS``), in start order; ``ports``: enough free 127.0.0.1 ports
    (6); the last server is the one clients call."""
    from backend.engine.host import metadata_only_engine_args

    ckpt = topology.checkpoint.resolve()
    if kind == "vllm-single":
        return [Server("api server", api_server_argv(ckpt, ports[0], engine_settings(topology, "baseline", "llm")),
                       ports[0])]
    if kind == "vllm-e-pd":
        settings, dev = engine_settings(topology, "E+PD", "pd"), buffer_device(topology, "pd")
        encoder = encoder_settings(settings)
        return [Server("encoder", api_server_argv(ckpt, ports[0], encoder, *ENCODER_FLAGS, "--ec-transfer-config",
                                                  ec_config("ec_producer", ec_dir, dev)), ports[0]),
                Server("pd", api_server_argv(ckpt, ports[1], metadata_only_engine_args(settings), "--ec-transfer-config",
                                             ec_config("ec_consumer", ec_dir, dev)), ports[1]),
                Server("proxy", proxy_argv(proxy, ports[2], [ports[0]], None, ports[1]), ports[2])]
    if kind not in ("vllm-e-p-d", "vllm-e-p-d-delay"):
        raise ValueError(f"unknown vLLM stack {kind!r}; known: {', '.join(VLLM_STACKS)}")
    delay = {"VLLM_PLUGINS": PLUGIN, POLL_DELAY_ENV: str(poll_delay_us)} if kind.endswith("-delay") else {}
    prefill = metadata_only_engine_args(engine_settings(topology, "E/P/D", "prefill"))
    decode = metadata_only_engine_args(engine_settings(topology, "E/P/D", "decode"))
    p_dev, d_dev = buffer_device(topology, "prefill"), buffer_device(topology, "decode")
    encoder = encoder_settings(engine_settings(topology, "E/P/D", "prefill"))
    return [Server("encoder", api_server_argv(ckpt, ports[0], encoder, *ENCODER_FLAGS, "--ec-transfer-config",
                                              ec_config("ec_producer", ec_dir, p_dev)), ports[0]),
            Server("prefill", api_server_argv(ckpt, ports[1], prefill, "--ec-transfer-config",
                                              ec_config("ec_consumer", ec_dir, p_dev), "--kv-transfer-config",
                                              kv_config("kv_producer", p_dev)), ports[1],
                   {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[3]), **delay}),
            Server("decode", api_server_argv(ckpt, ports[2], decode, "--kv-transfer-config",
                                             kv_config("kv_consumer", d_dev)),
                   ports[2], {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[4]), **delay}),
            Server("proxy", proxy_argv(proxy, ports[5], [ports[0]], ports[1], ports[2]), ports[5])]


def process_env(server: Server) -> dict[str, str]:
    """The environment a vLLM-side process starts with: this one's without the project's ``EPD_*`` switches, then
    ``VLLM_ENV``, then the server's own."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return {**base, **VLLM_ENV, **server.env}


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200; raises if ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before {url} was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not up yet, or not HTTP there
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the process group ``proc`` leads (started with a session of its own), SIGKILL it after ``timeout``."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            time.sleep(0.2)  # its children, if any, got the signal with it
            if sig == signal.SIGTERM:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group
            return
        except subprocess.TimeoutExpired:
            continue


def start_waves(servers: list[Server], together: bool) -> list[list[Server]]:
    """The order ``running`` starts ``servers`` in: one at a time, or (``together``) every engine server at once
    and then the proxy (whose /health asks theirs)."""
    if not together:
        return [[server] for server in servers]
    engines = [s for s in servers if s.name != "proxy"]
    return [engines, *([[s] for s in servers if s.name == "proxy"])]


@contextlib.contextmanager
def running(servers: list[Server], log_dir: Path, start_timeout: float = 600.0, together: bool = False):
    """Start ``servers`` in order, each once the previous one is healthy (``together``: the engine servers at once,
    then the proxy once they are all healthy, as ours start their engines at once; with an explicit KV size each,
    ``kv_cache_memory_bytes``, no engine's memory profile depends on another's); yields {group name: [pid]}; stops
    them all, last first, however the block ends. vLLM's ZMQ IPC sockets go into a temporary directory of this call
    (``VLLM_RPC_BASE_PATH``), removed after the stop (in /tmp, 3 sockets per server were left behind)."""
    import shutil
    import tempfile

    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[tuple[Server, subprocess.Popen]] = []
    ipc = tempfile.mkdtemp(prefix="side-by-side-ipc-")
    try:
        for wave in start_waves(servers, together):
            for server in wave:
                with open(log_dir / f"{server.name.replace(' ', '-')}.log", "wb") as log:
                    proc = subprocess.Popen(server.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            # their TMPDIR too: each EngineCore leaves a vllm_dist_* directory
                                            env={**process_env(server), "VLLM_RPC_BASE_PATH": ipc, "TMPDIR": ipc},
                                            start_new_session=True)
                started.append((server, proc))
            for server, proc in started[-len(wave):]:
                wait_healthy(f"http://127.0.0.1:{server.port}/health", start_timeout, proc)
        yield {server.name: [proc.pid] for server, proc in started}
    finally:
        for _, proc in reversed(started):
            stop_group(proc)
        shutil.rmtree(ipc, ignore_errors=True)


class OursStack(NamedTuple):
    """What ``ours_running`` yields."""

    base_url: str  # the OpenAI endpoint's
    grpc_url: str
    model: str
    groups: dict[str, list[int]]  # process group name -> [pid]
    metrics_url: str  # tritonserver's Prometheus metrics


@contextlib.contextmanager
def ours_running(topology, row: str, log_dir: Path, in_process: bool = False, endpoint_flags: tuple[str, ...] = ()):
    """tritonserver serving ``topology`` rendered for ``row``'s deployment alone (``OURS``) and ``frontend.openai``
    in front of it (started with ``endpoint_flags`` too; ``in_process``: the endpoint in the served model's process
    instead, topology ``openai_port``), on free 127.0.0.1 ports. Yields an ``OursStack``; stops both on exit
    (TritonServer stops its own process group)."""
    import tempfile

    from backend.deploy.local_server import Ports, TritonServer, start_openai_process
    from backend.deploy.ports import free_ports
    from backend.deploy.render import render

    *server_ports, port = free_ports(4)  # distinct: the server's and the endpoint's
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as repo, \
            tempfile.TemporaryDirectory(prefix="side-by-side-tmp-") as tmp:
        served = render(topology.only(OURS[row], openai_port=port if in_process else 0), Path(repo))
        model = "llm" if "llm" in served else "epd"
        log = log_dir / f"{row}{'-in-process' if in_process else ''}-tritonserver.log"
        # TMPDIR: what the server's processes leave in it (each EngineCore a vllm_dist_* directory) goes with it
        with TritonServer(Path(repo), ports=Ports(*server_ports), log_path=log,
                          env={**os.environ, "TMPDIR": tmp}) as server:
            if in_process:
                wait_healthy(f"http://127.0.0.1:{port}/health", 120)
                yield OursStack(f"http://127.0.0.1:{port}", server.grpc_url, model,
                                {"tritonserver group": [server.proc.pid]}, server.metrics_url)
                return
            endpoint = start_openai_process(port, server.grpc_url, "--models", model, *endpoint_flags)
            try:
                wait_healthy(f"http://127.0.0.1:{port}/health", 120, endpoint)
                yield OursStack(f"http://127.0.0.1:{port}", server.grpc_url, model,
                                {"tritonserver group": [server.proc.pid], "openai endpoint": [endpoint.pid]},
                                server.metrics_url)
            finally:
                endpoint.terminate()
                try:
                    endpoint.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    endpoint.kill()
                    endpoint.wait(timeout=10)

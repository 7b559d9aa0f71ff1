"""Hosting one in-process vLLM ``AsyncLLM`` inside a Triton Python model (or any process).

Who calls it: a generating model's ``initialize`` calls ``EngineHost.start(engine_args)``; ``execute``
schedules coroutines with ``submit``; ``finalize`` calls ``shutdown``. The engine lives on a private
asyncio loop in a daemon thread, because the Triton stub's ``execute`` must return at once for a
decoupled model while responses keep streaming.

Engine arguments come from a ``model.json`` beside ``config.pbtxt`` and go straight to
``AsyncEngineArgs`` (like Triton's vllm_backend); relative paths in it are resolved against its folder.
"""
from __future__ import annotations

import asyncio
import atexit
import faulthandler
import functools
import gc
import json
import locale
import os
import shutil
import signal
import sys
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Coroutine

from backend.engine.leave import leave_now
from backend.engine.logprobs import token_entries
from backend.engine.loop import LoopThread
from backend.engine.stats import stat_logger_factory
from backend.protocol.errors import InvalidInput, Unavailable
from backend.protocol.modality import modalities, modality
from backend.protocol.versions import Guard
from backend.request.generate import GenerateRequest
from backend.request.media import modality_of

PATH_KEYS = ("model", "tokenizer", "allowed_local_media_path", "download_dir")
START_METHOD_ENV = "EPD_ENGINE_START_METHOD"  # how EngineCores start: fork (PROCESS_ENV_DEFAULTS) or spawn

# Measured on 2 cores (docs/results/foundation.md): more OpenMP threads per engine made a 16-token request 50x slower,
# and the default binds every engine to core 0. Set before vLLM/torch are imported; the operator's
# environment wins.
PROCESS_ENV_DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    "EPD_OMNI_AUDIO_EMBEDS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    # oneDNN's process-wide primitive cache (default 1024 entries) keeps a primitive for every GEMM shape
    # it has seen, ~0.6-1 MiB each whatever the weight size; a prefilling engine meets a new token count
    # almost every step, so its EngineCore grew by hundreds of MiB over a soak (docs/results/robustness.md, "Soak").
    # vLLM's CPU GEMMs already keep their own primitives (32 most recent shapes per layer), so the global
    # cache only adds memory; measured: 0.2-0.9 ms more for a GEMM whose shape left vLLM's cache.
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
    # vLLM's CPU worker makes a dozen gloo process groups (world size 1 here), each with a transport device
    # of its own whose loop thread wakes every 10 ms: ~1,300 wake-ups a second, ~1.2% of a core per idle
    # engine. The project's vLLM plugin gives them one shared device (backend.engine.patches.share_gloo_device).
    "EPD_GLOO_SHARED_DEVICE": "1",
    # A stopped EngineCore exits once its clean shutdown is done, without the interpreter's teardown of its heap:
    # every unload and server stop waited 2-3 s more per engine for it (backend.engine.patches.patch_quick_exit).
    "EPD_ENGINE_QUICK_EXIT": "1",
    # The EngineCore forked from its stub, not spawned (vLLM's CPU platform sets spawn; with CUDA initialized in the
    # stub vLLM spawns whatever this says): a spawned one imports torch and vLLM again (~6 s of CPU here) and touches
    # ~500 MiB of new memory; forked, it shares the stub's pages. The stub has run no OpenMP region and holds no
    # engine state or NIXL agent when it forks (backend.triton.generate_model: start_more_engines;
    # engine_start_method). Measured on the README's server (docs/results/ci-time.md): start-up CPU of its
    # processes 94 -> 47 s. "spawn" gives vLLM's choice back.
    START_METHOD_ENV: "fork",
    # An EngineCore exits when its stub is gone, however the stub ended: vLLM only ever stops it from the stub, so a
    # stub killed, or ended by tritonserver's exit timeout, left it running (backend.engine.patches.follow_parent).
    "EPD_ENGINE_FOLLOW_PARENT": "1",
}

# Checked on vLLM 0.32 (CPU) and 0.26.0 (GPU: AsyncLLM.shutdown and its output_handler task are the same code);
# 0.27-0.31 were not looked at.
QUIET_SHUTDOWN = Guard("quiet engine shutdown", "vllm", "0.26", "0.33",
                       "an EngineDeadError logged by the engine's output handler and a TypeError printed by "
                       "AsyncLLM.__del__ at interpreter exit, at every unload")

# Engine arguments of the engines fed embeddings or layouts (pd, prefill, decode), under model.json's.
# vLLM's multimodal processor cache (mm_processor_cache_gb, 4 GiB by default) keeps every item the
# engine received, in the EngineCore too, until that budget (counted in tensor bytes) is full: pulled
# embeddings are never processed again, so for them it only grows the EngineCore (~13 KiB an item).
METADATA_ONLY_ENGINE_DEFAULTS = {"mm_processor_cache_gb": 0}


def metadata_only_engine_args(model_json: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments of an engine fed embeddings or layouts (pd, prefill, decode): model.json's over
    ``METADATA_ONLY_ENGINE_DEFAULTS``, with ``enable_mm_embeds`` (what such an engine needs to work)."""
    return {**METADATA_ONLY_ENGINE_DEFAULTS, **model_json, "enable_mm_embeds": True}


def kv_transfer_config(role: str, on_gpu: bool, lease_seconds: int = 30) -> dict[str, Any]:
    """vLLM's NixlConnector settings of a ``kv_producer`` (prefill) or ``kv_consumer`` (decode) engine: KV
    buffers in host memory on CPU, in device memory on GPU; a KV that cannot be loaded fails the request
    (decode has no embeddings to recompute it with); a finished request's KV kept ``lease_seconds`` for a decode
    that has not read it (the connector's ``kv_lease_duration``; both sides need the same: the consumer renews it
    every sixth of it while it waits)."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cuda" if on_gpu else "cpu",
            "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"kv_lease_duration": int(lease_seconds)}}


@functools.lru_cache(maxsize=1)
def takes_layout_only() -> bool:
    """Whether this vLLM takes a KV consumer's media as layout only (``image_grid_thw`` without ``image_embeds``):
    vLLM 0.32 derives ``MultiModalConfig.allow_missing_mm_embeddings`` for a KV consumer; 0.26 has no such field and
    its parser needs the embeddings tensor (checked 2026-12-01: "The data should contain the fields:
    {'image_embeds', 'image_grid_thw'}"), so the consumer passes zeros there (``placeholder_media_embeds``)."""
    from vllm.config.multimodal import MultiModalConfig

    return "allow_missing_mm_embeddings" in getattr(MultiModalConfig, "__dataclass_fields__", {})


def load_engine_args(path: Path) -> dict[str, Any]:
    """Read a model.json; relative paths are resolved against its folder. Keys starting with ``_`` are notes (the
    renderer's ``_generated``), not engine arguments."""
    args = json.loads(Path(path).read_text())
    if not isinstance(args, dict) or "model" not in args:
        raise ValueError(f"{path}: expected a JSON object with at least a 'model' key")
    args = {key: value for key, value in args.items() if not key.startswith("_")}
    for key in PATH_KEYS:
        value = args.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value) and value.startswith("."):
            args[key] = str((Path(path).parent / value).resolve())
    return args


def prepare_process() -> None:
    """Process-wide settings for a Triton stub: the UTF-8 locale vLLM/torch need (the stub's is ASCII),
    the environment defaults above, and torch's intra-op threads.

    Threads: the model files import torch before ``initialize`` runs, so ``OMP_NUM_THREADS`` set here
    comes too late for this process's pool; it is applied with ``torch.set_num_threads``. Measured on
    the 2-core machine: the tiny vision tower takes 2.1 ms of CPU per image with one thread and 4.6 ms
    with two (same wall time), and under load, with every stage sharing the cores, the spinning second
    thread made the encoder cost ~11 ms of CPU per image."""
    locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
    # SIGUSR1 prints every thread's stack to stderr (the server's log): backend.deploy.local_server sends it to a stub
    # that outlives tritonserver before killing it, so a hang at unload says where it hung
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    for key, value in PROCESS_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


def engine_start_method(may_fork: bool = True) -> str:
    """How this process's next EngineCore starts: ``START_METHOD_ENV`` (the stub's default is "fork": read it after
    ``prepare_process``; read before, every EngineCore was spawned from 2026-12-07 08:10 to 15:00 UTC: 10 s of CPU
    each, not 2), but "spawn" for a "fork" where the caller says it may not fork: once the process has made a NIXL
    agent (``backend.transfer.agent.agents_in_process``), a forked child shares the agent's UCX state, and the child's
    UCX thread and this process's then spin a core each for good (measured: an E/P/D orchestrator whose decode
    EngineCore forked after its embeddings consumer's agent; ``GenerateModel.start_more_engines`` now starts it
    before)."""
    method = os.environ.get(START_METHOD_ENV, "")
    if method == "fork" and not may_fork:
        print("epd: a NIXL agent exists in this process: its next EngineCore is spawned, not forked", file=sys.stderr,
              flush=True)
        return "spawn"
    return method


EXIT_WATCHDOG_SECONDS = 10.0


def bound_the_exit(seconds: float = EXIT_WATCHDOG_SECONDS) -> None:
    """Called last in a model's ``finalize``: if this stub is still alive ``seconds`` from now, faulthandler prints
    every thread's stack into the server's log and ends the process (``_exit(1)``), from a C thread of its own that
    needs no GIL. After ``finalize`` the stub only tears down (its model object, then the interpreter); measured
    (2026-12-01, 2-encoder deployments, about 1 server stop in 3): an encoder stub hung there for good, its main thread
    in the garbage collector blocked in libc (``py-spy dump --native``: ``gc_collect_main`` -> libc, no other thread
    left), so tritonserver waited out its 30 s exit timeout and exited with the stub still running. Normal teardown
    takes well under a second, so the bound never cuts one short.

    And the stub leaves at the start of the interpreter's teardown (``_leave_before_teardown``, an ``atexit`` handler
    registered last, so run first), after its own C++ teardown, without the interpreter's last garbage collection:
    seen taking the 10 s of the bound in the stops of the fresh-clone CI run of 5246150 (py-spy: ``gc_collect_main``,
    active, up to 8 stubs at once on 2 cores), and what it freed then crashed stubs (docs/results/robustness.md)."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    atexit.register(_leave_before_teardown)


def _leave_before_teardown() -> None:
    """The other ``atexit`` handlers (multiprocessing's, vLLM's, logging's), the streams flushed, then ``_exit(0)``."""
    atexit.unregister(_leave_before_teardown)
    leave_now(0)


FINALIZE_STACKS_SECONDS = 20.0


def report_a_slow_finalize(seconds: float = FINALIZE_STACKS_SECONDS) -> None:
    """Called first in a vLLM model's ``finalize``: if the stub has not reached ``bound_the_exit`` ``seconds`` from
    now, faulthandler prints every thread's stack into the server's log (from a C thread of its own that needs no
    GIL), and the stub carries on. ``finalize`` stops the engine (vLLM's 5 s grace, then at most 5 s more:
    ``stop_engine_processes``); tritonserver gives up on an unload after its 30 s exit timeout and the stub ends with
    it, saying nothing of where it was. Measured (CI, 2026-12-03, tests/e2e/test_hosts.py): a pd stub did not
    finish its unload in those 30 s, its EngineCore never asked to stop; this says where the next one is."""
    faulthandler.dump_traceback_later(seconds, exit=False)


@dataclass(frozen=True)
class GenerationDelta:
    """What one engine step added: new text, cumulative counts, and the finish reason when done."""

    text: str
    num_input_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    kv_transfer_params: dict | None = None  # from a KV producer's final output (prefill)
    cached_tokens: int | None = None  # on the final delta: prompt tokens vLLM's prefix cache covered
    logprobs: list | None = None  # the new tokens' entries (backend.engine.logprobs), when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _vllm_error_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """vLLM's exception classes that ``_domain_error`` maps: (overload or shutdown, request fault). vLLM 0.32
    (checked) has ``GracefulHTTPError`` and ``RetryableRequestError`` for the first and the ``VLLMClientError``
    family for the second; vLLM 0.26 (checked on the GPU machine) has none of them: its request faults are
    ValueErrors (``VLLMValidationError``) and a dead engine is ``EngineDeadError``, matched by name."""
    from vllm import exceptions

    def present(*names: str) -> tuple[type, ...]:
        return tuple(getattr(exceptions, name) for name in names if hasattr(exceptions, name))

    return present("GracefulHTTPError", "RetryableRequestError"), present("VLLMClientError") + (ValueError,)


def multi_modal_data(request: GenerateRequest) -> dict[str, Any]:
    """vLLM's ``multi_modal_data`` of a request, per modality (``Modality.data_key``): its pulled embeddings through
    vLLM's embedding input (``{embeds_key: tensor, grid_key: grid}``, and the layouts' other fields, ``media_kwargs``:
    a video's ``second_per_grid_ts`` or ``timestamps``; the grid alone for a KV consumer, whose KV already covers the
    media positions), or its decoded items in prompt order (a video as (frames, metadata))."""
    if request.media_embeds is not None:
        data = {}
        for name, (embeds, grid_thw) in request.media_embeds.items():
            m = modality(name)
            fields = {**(request.media_kwargs or {}).get(name, {}), m.grid_key: grid_thw}
            data[m.data_key] = fields if embeds is None else {m.embeds_key: embeds, **fields}
        return data
    data: dict[str, list] = {}
    for item in request.items:
        engine_item = getattr(item, "engine_item", None)
        data.setdefault(modality(modality_of(item)).data_key, []).append(engine_item() if engine_item else item)
    return data


def _engine_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """``SamplingParams``' keyword arguments of a request's sampling parameters: ``structured_outputs`` (a dict,
    ``backend.request.sampling``) as vLLM's ``StructuredOutputsParams``."""
    if sampling.get("structured_outputs") is None:
        return sampling
    from vllm.sampling_params import StructuredOutputsParams

    return {**sampling, "structured_outputs": StructuredOutputsParams(**sampling["structured_outputs"])}


STRUCTURED_FIELD = "sampling_parameters.structured_outputs"


def _domain_error(exc: Exception, request: GenerateRequest) -> Exception:
    """Map vLLM's exceptions to domain errors: request faults (its VLLMClientError family, and the
    ValueErrors its input processing raises) -> InvalidInput naming the field (a modality's item limit, e.g. audio
    given to a model without audio: the modality's tensor); overload and a dead
    engine -> Unavailable; anything else stays internal."""
    unavailable, client = _vllm_error_classes()
    if type(exc).__name__ == "EngineDeadError" or isinstance(exc, unavailable):
        return Unavailable(f"engine unavailable: {exc}")
    if isinstance(exc, client):
        parameter = getattr(exc, "parameter", None)
        media = {m.limit_key: m.media_tensor for m in modalities()}  # vLLM's item limits name the modality
        field = (request.prompt_field if parameter in (None, "input_tokens", "prompt")
                 else media.get(parameter) or f"sampling_parameters.{parameter}")
        if parameter is None and request.sampling.get("structured_outputs") is not None and _about_structure(exc):
            field = STRUCTURED_FIELD  # vLLM names no parameter when a schema or grammar does not compile
        return InvalidInput(field, str(exc))
    return exc


def _about_structure(exc: Exception) -> bool:
    """Whether vLLM's validation error is about the request's structured outputs (vLLM 0.32's messages: "Failed to
    transform json schema into a grammar", "Invalid JSON grammar specification", "structured_outputs.json ...")."""
    text = str(exc).lower()
    return any(word in text for word in ("grammar", "schema", "structured", "json", "regex"))


IPC_PREFIX = "epd-vllm-ipc-"  # a private_ipc_dir (its EngineCore keeps its store file there: patches)
_IPC_BASE: str | None = None
_IPC_ENV_BEFORE: str | None = None  # VLLM_RPC_BASE_PATH as this process found it (None: unset)


def private_ipc_dir() -> str:
    """A new directory for vLLM's ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``, inherited by the EngineCore), under
    the one configured, else the temp directory. vLLM names its sockets ``<base>/<uuid4>`` and leaves the
    files behind: measured, 12 sockets left in /tmp by one start and stop of the ``llm`` test server, ~1,000
    after a day of tests. Give it back with ``release_ipc_dir``."""
    global _IPC_BASE, _IPC_ENV_BEFORE
    if _IPC_BASE is None:  # later hosts of this process: the same base, not an earlier host's directory
        _IPC_ENV_BEFORE = os.environ.get("VLLM_RPC_BASE_PATH")
        _IPC_BASE = _IPC_ENV_BEFORE or tempfile.gettempdir()
    _remove_orphaned_ipc_dirs(_IPC_BASE)
    path = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{_process_stamp(os.getpid())}-", dir=_IPC_BASE)
    os.environ["VLLM_RPC_BASE_PATH"] = path
    return path


def _process_stamp(pid: int) -> str | None:
    """``<pid>-<start time>``: names one process, not a later one given the same pid. The start time is the
    kernel's, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd field), which no change of the wall clock moves
    (psutil's ``create_time`` adds a boot time read from the wall clock). None: no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return f"{pid}-{int(fields[19])}"  # field 22 overall; the split starts at field 3 (the state)


def _remove_orphaned_ipc_dirs(base: str) -> None:
    """Remove the private directories whose process is gone: a stub killed (a host lost, Triton's exit timeout, a
    SIGKILL) never reaches ``release_ipc_dir``; measured, each fresh-clone CI run left one (test_hosts kills a
    host's tritonserver). A directory's name carries its process's pid and start time
    (``epd-vllm-ipc-<pid>-<start>-<random>``); one whose process still runs, or that is named otherwise, is left.
    This assumes the processes sharing ``base`` share one pid namespace (a container has its own temp directory)."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(IPC_PREFIX)]
    except OSError:
        return
    for name in names:
        pid, _, rest = name[len(IPC_PREFIX):].partition("-")
        start = rest.partition("-")[0]
        if pid.isdigit() and start.isdigit() and _process_stamp(int(pid)) != f"{pid}-{start}":
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def release_ipc_dir(path: str) -> None:
    """Remove a ``private_ipc_dir`` and, where the environment still names it, put back what it said before:
    a process started afterwards (seen: a test's tritonserver after an engine test in the same pytest process)
    would otherwise inherit a removed directory as its base and fail every engine's start in mkdtemp."""
    shutil.rmtree(path, ignore_errors=True)
    if os.environ.get("VLLM_RPC_BASE_PATH") == path:
        if _IPC_ENV_BEFORE is None:
            os.environ.pop("VLLM_RPC_BASE_PATH")
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = _IPC_ENV_BEFORE


class EngineHost:
    CANCEL_SECONDS = 10.0  # how long shutdown waits for the loop to cancel vLLM's output handler

    def __init__(self, loop: LoopThread, engine, tokenizer, ipc_dir: str | None = None, processes=(),
                 owns_loop: bool = True):
        """``processes``: the engine's (``psutil.Process``, made by ``start``): ``shutdown`` makes sure they are gone,
        and touches no other process of the host's. ``owns_loop``: ``shutdown`` stops the loop too."""
        self._loop, self._engine, self._tokenizer, self._ipc_dir = loop, engine, tokenizer, ipc_dir
        self._processes, self._owns_loop = list(processes), owns_loop
        self.session_key: str | None = None  # kv_transfer_params' key for a request's session (backend.engine.session_kv)

    @classmethod
    def start(cls, engine_args: dict[str, Any], stats_observer=None, beside: "EngineHost | None" = None,
              may_fork: bool = True) -> "EngineHost":
        """``stats_observer``: a ``backend.engine.stats.StatsObserver`` given vLLM's request metrics. ``beside``: a
        host whose loop this engine shares (two engines one coroutine drives: E/P/D's prefill and decode in the
        orchestrator's process); its ``shutdown`` stops this engine only, the loop stays ``beside``'s. Its EngineCore
        starts as ``engine_start_method(may_fork)`` says, read here, after ``prepare_process`` set the stub's
        defaults (``may_fork`` False: no fork, the process has a NIXL agent)."""
        prepare_process()
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        loop = beside._loop if beside is not None else LoopThread("vllm-engine-loop")
        ipc_dir = private_ipc_dir()

        args = dict(engine_args)
        if isinstance(args.get("kv_transfer_config"), dict):
            from vllm.config import KVTransferConfig
            args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])

        loggers = None
        if stats_observer is not None:
            loggers = [stat_logger_factory(stats_observer)]

        async def create():
            engine_args = AsyncEngineArgs(**args)
            vllm_config = engine_args.create_engine_config()
            method = engine_start_method(may_fork)
            if method in ("fork", "spawn"):  # after the config: vLLM's CPU platform sets "spawn" there
                os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method
            return AsyncLLM.from_vllm_config(vllm_config, stat_loggers=loggers,
                                             enable_log_requests=engine_args.enable_log_requests,
                                             disable_log_stats=engine_args.disable_log_stats)

        import psutil

        others = {proc.pid for proc in psutil.Process().children(recursive=True)}
        try:
            engine = loop.submit(create()).result()
        except BaseException:
            if beside is None:
                loop.stop()
            release_ipc_dir(ipc_dir)  # and the environment's base back: a process started later must not inherit it
            raise
        processes = [proc for proc in psutil.Process().children(recursive=True)
                     if proc.pid not in others and _engine_process(proc)]
        tokenizer = AutoTokenizer.from_pretrained(engine_args.get("tokenizer") or engine_args["model"])
        host = cls(loop, engine, tokenizer, ipc_dir, processes, owns_loop=beside is None)
        from backend.engine.session_kv import SESSION_KEY, keeps_sessions

        if keeps_sessions(engine_args.get("kv_transfer_config")):
            host.session_key = SESSION_KEY  # the engine keeps conversations' KV: tell it each request's
        return host

    def submit(self, coro: Coroutine) -> Future:
        return self._loop.submit(coro)

    def prompt_text(self, request: GenerateRequest) -> str:
        """The prompt the engine sees: ``text_input`` as is, or the conversation through the chat template."""
        if request.prompt is not None:
            return request.prompt
        return self._tokenizer.apply_chat_template(request.conversation, tools=request.tools, tokenize=False,
                                                   add_generation_prompt=True)

    async def generate(self, request: GenerateRequest, request_id: str) -> AsyncIterator[GenerationDelta]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kv_params = request.kv_transfer_params
        if self.session_key is not None and request.session_id:
            kv_params = {**(kv_params or {}), self.session_key: request.session_id}
        extra = {"kv_transfer_params": kv_params} if kv_params else None
        try:
            params = SamplingParams(**_engine_sampling(request.sampling), output_kind=RequestOutputKind.DELTA,
                                    extra_args=extra)
        except (TypeError, ValueError) as exc:
            raise InvalidInput("sampling_parameters", str(exc)) from None
        prompt: dict[str, Any] = {"prompt": self.prompt_text(request)}
        media = multi_modal_data(request)
        if media:
            prompt["multi_modal_data"] = media
        if request.media_embeds is not None and request.media_uuids:
            # the items' content keys as vLLM's item ids: its prefix cache then covers an item sent again whatever
            # embeddings it comes with (a re-encode may differ in the last bits), and vLLM hashes no tensor
            prompt["multi_modal_uuids"] = {modality(name).data_key: list(keys) for name, keys in request.media_uuids.items()}
        produced, top = 0, request.sampling.get("logprobs")
        try:
            async for out in self._engine.generate(prompt, params, request_id, priority=request.priority):
                completion = out.outputs[0]
                produced += len(completion.token_ids)
                if out.finished and completion.finish_reason == "error":  # e.g. the KV could not be loaded
                    raise Unavailable(f"the engine failed this request (finish_reason=error"
                                      f"{', a KV transfer' if request.kv_transfer_params else ''})")
                yield GenerationDelta(completion.text, len(out.prompt_token_ids or ()), produced,
                                      completion.finish_reason if out.finished else None,
                                      getattr(out, "kv_transfer_params", None) if out.finished else None,
                                      getattr(out, "num_cached_tokens", None) if out.finished else None,
                                      None if top is None else token_entries(completion.token_ids, completion.logprobs,
                                                                             top, self._decode))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _domain_error(exc, request) from exc

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    def shutdown(self) -> None:
        """Stop the engine (and its EngineCore child) and the loop thread; safe to call twice."""
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                self._stop_quietly(engine)
            finally:  # whatever the stop raised, the engine's processes go
                stop_engine_processes(self._processes)
        if self._owns_loop:
            self._loop.stop()
        # Let AsyncLLM.__del__ run now, while the interpreter is whole, not at stub exit.
        del engine
        gc.collect()
        if self._ipc_dir is not None:
            release_ipc_dir(self._ipc_dir)

    def _stop_quietly(self, engine) -> None:
        """``engine.shutdown()``, using two AsyncLLM internals where ``QUIET_SHUTDOWN`` allows: the output handler
        task is stopped first, or it logs the engine's exit as an EngineDeadError; and ``shutdown`` becomes a
        no-op afterwards, because AsyncLLM.__del__ calls it again whenever the object goes, which was seen to be at
        interpreter exit (a reference outlives this method), where the module globals it uses are gone: a
        TypeError printed at every unload."""
        quiet = QUIET_SHUTDOWN.allows(engine, "output_handler", "shutdown")
        handler = engine.output_handler if quiet else None
        if handler is not None:
            try:
                self.submit(_cancel_and_wait(handler)).result(timeout=self.CANCEL_SECONDS)
            except TimeoutError:  # the loop is stuck or busy: the engine is stopped all the same, not left running
                print(f"epd: the engine loop did not cancel vLLM's output handler in {self.CANCEL_SECONDS:g} s; "
                      "stopping the engine anyway", file=sys.stderr, flush=True)
        engine.shutdown()
        if quiet:
            engine.shutdown = lambda *args, **kwargs: None


def stop_engine_processes(engines, timeout: float = 5.0) -> None:
    """Make sure the engine processes (``_engine_process``) are gone: wait ``timeout`` s, then kill them.

    Measured: an EngineCore with the NIXL connector sometimes outlives ``shutdown()`` for more than 20 s, and
    vLLM itself kills every EngineCore it waited 5 s for; whoever started it makes sure it is gone, or it
    leaks (memory, /dev/shm) past the server. multiprocessing's resource tracker is left alone: it never exits
    while this process lives, and when this process exits it unlinks what a killed EngineCore registered with
    it and could not remove itself (the POSIX semaphore ``/dev/shm/sem.mp-*`` of tqdm's lock, one per engine,
    made while the weights load). Killing the tracker here too left those behind: 4 per server stop."""
    import psutil

    _, alive = psutil.wait_procs(engines, timeout=timeout)
    alive = [proc for proc in alive if _alive(proc)]
    for proc in alive:
        proc.kill()
    psutil.wait_procs(alive, timeout=5)


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _engine_process(proc) -> bool:
    """A child that exits when the engine shuts down: not multiprocessing's resource tracker, which runs
    until this process exits (its pipe closes)."""
    import psutil

    try:
        return not any("resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


async def _cancel_and_wait(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

"""The Triton adapter shared by the vLLM-hosting models (``llm``, ``pd``, ``prefill``, ``decode``, the colocated
orchestrators): read config once (``backend.triton.config``), host the engine, convert tensors, hand each parsed
request to ``backend.engine.serving``. Each ``model.py`` subclasses ``GenerateModel`` and names its stage role
(``backend.protocol.stages``) and its settings class; the role's spec says what differs (how media are resolved,
whether embeddings are pulled, the engine's KV role).

Imported by ``model.py`` files only (it imports ``triton_io``, hence ``pb_utils``).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from backend.deploy.ports import free_ports
from backend.encode.checkpoint import embedding_width, model_identity
from backend.engine.host import (EngineHost, bound_the_exit, kv_transfer_config, load_engine_args,
                                 metadata_only_engine_args, report_a_slow_finalize, takes_layout_only)
from backend.engine.patches import NICE_ENV
from backend.engine.serving import stream_generation
from backend.protocol.errors import InvalidInput
from backend.protocol.generate import HELD_PARAMETER, LOAD_PARAMETER
from backend.protocol.layout import LayoutMetadata
from backend.protocol.modality import modalities
from backend.protocol.settings import EngineSettings, KvEngineSettings
from backend.protocol.stages import RoleSpec, Stage
from backend.request.generate import (GenerateRequest, LayoutMedia, LayoutOrDecodeMedia, MediaResolver, RequestLimits,
                                      checkpoint_media, parse_generate_request)
from backend.request.media import MediaLimits, decode_counter, media_limits
from backend.request.naive_media import process_original_media
from backend.transfer.agent import POLL_DELAY_ENV, agents_in_process
from backend.transfer.announce import ProducerWatcher, directory
from orchestrator.cancel_board import CancelBoard
from backend.triton.config import in_process_endpoint, instance_count, load_settings
from backend.triton.counter_batch import CounterBatch
from backend.triton.io import (ERROR_CODES_PARAMETER, answer_held_lookup, answer_json, in_band_cancel,
                               read_generate_inputs, request_parameters, send_error, watched_sink)
from backend.triton.metrics import EngineMetrics, RequestMetrics


class GenerateModel:
    """Subclasses name their ``ROLE`` and ``SETTINGS``, implement ``make_resolver`` and may override ``prepare``
    (runs on the engine loop before generation; its errors fail that request only) and ``engine_args_from`` (the
    engine arguments made of model.json's)."""

    ROLE = Stage.LLM
    SETTINGS: type[EngineSettings] = EngineSettings

    def initialize(self, args: dict[str, Any]) -> None:
        self.name = args["model_name"]
        config = json.loads(args["model_config"])
        self.instances = instance_count(config)
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(f"{self.name} must use the decoupled transaction policy")
        self.settings = load_settings(self.SETTINGS, args)
        self.check_settings()
        self.spec = self.role_spec()
        model_dir = Path(args["model_repository"])
        # A KIND_GPU instance: its engine runs on the instance's GPU (Triton gives each instance one device id)
        self.on_gpu = args.get("model_instance_kind") == "GPU"
        if self.on_gpu:  # before anything initializes CUDA in this stub; the EngineCore child inherits it
            os.environ["CUDA_VISIBLE_DEVICES"] = str(args.get("model_instance_device_id", "0"))
        self.engine_args = self.engine_args_from(load_engine_args(model_dir / self.settings.engine_args))
        per_prompt = self.engine_args.get("limit_mm_per_prompt", {})
        self.limits = RequestLimits(
            **{m.limit_field: int(per_prompt.get(m.limit_key, 8)) for m in modalities()},
            media=MediaLimits(
                **media_limits(self.settings), **checkpoint_media(self.engine_args["model"]),
                allowed_local_media_path=self.engine_args.get("allowed_local_media_path", ""),
                allowed_media_domains=tuple(d.lower() for d in self.engine_args.get("allowed_media_domains") or ()),
            ),
            priority_levels=self.settings.priority_levels,
        )
        self.stream_interval = self.settings.stream_interval_ms / 1000  # see stream_generation
        self.resolver = self.make_resolver()
        self.metric_batch = CounterBatch()  # this model's counters, handed to Triton a few times a second
        instance = args.get("model_instance_name", "")  # a label of each instance's metrics (metric_labels)
        self.metrics = RequestMetrics(self.name, self.metric_batch, instance)
        self.engine_metrics = EngineMetrics(self.name, self.metric_batch, instance)
        self.host = self.start_engine(self.engine_args, self.engine_metrics)
        self.start_more_engines(args)
        self.cancels = CancelBoard.for_model(self.name)  # in-band cancels (epd_cancel) of this model's requests
        self.openai = None  # the OpenAI endpoint in this process (serve_openai), if the config asks for one
        if self.ROLE is Stage.LLM:
            self.serve_openai(self.answer)

    def serve_openai(self, answer) -> None:
        """Serve the OpenAI-compatible endpoint from this process on the engine's loop, each request answered by
        ``answer(raw, parameters, sink)`` (``frontend.openai.in_process``), if the config has an ``openai_port``."""
        if getattr(self.settings, "openai_port", 0):
            serve_for = in_process_endpoint("openai")  # frontend.openai.in_process, plugged in (no upward import)
            self.openai = serve_for(self.name, self.settings, answer, self.host.submit, self.metrics, self.instances,
                                    self.engine_args["model"])

    async def answer(self, raw, parameters: dict, sink) -> None:
        """One request of the in-process OpenAI endpoint, as ``execute`` answers one (on the engine's loop)."""
        try:
            parsed = parse_generate_request(raw, self.resolver, self.limits)
        except Exception as exc:
            sink.send_error(exc)
            return
        finally:
            self.metrics.media_decodes(decode_counter.count)
        await stream_generation(self.host, parsed, sink, self.metrics, prepare=self.prepare,
                                interval=self.stream_interval)

    def check_settings(self) -> None:
        """Runs once the settings are read, before anything starts: a setting that cannot work fails the load."""

    def role_spec(self) -> RoleSpec:
        """What this model's engine takes and does: its role's spec."""
        return self.ROLE.spec

    def make_resolver(self) -> MediaResolver:
        raise NotImplementedError

    def engine_args_from(self, model_json: dict[str, Any]) -> dict[str, Any]:
        return model_json

    def start_engine(self, engine_args: dict[str, Any], metrics: EngineMetrics, spec: RoleSpec | None = None,
                     beside: EngineHost | None = None) -> EngineHost:
        """An engine of ``spec``'s role (None: this model's), started after this process's environment is set for
        that role (``process_env``: its EngineCore child inherits it); ``beside``: a host whose loop it shares."""
        for key, value in self.process_env(spec).items():
            os.environ[key] = value
        return EngineHost.start(engine_args, stats_observer=metrics, beside=beside, may_fork=not agents_in_process())

    def start_more_engines(self, args: dict[str, Any]) -> None:
        """Start this process's other engines (none here): right after the first, before anything of the model makes
        a NIXL agent (a consumer's), so their EngineCores fork from a process without UCX in it (a fork after it
        shares UCX's event descriptors: the child's progress thread and the stub's UCX thread then each spin a core;
        ``backend.engine.host.engine_start_method`` spawns instead where an agent already exists)."""

    def process_env(self, spec: RoleSpec | None = None) -> dict[str, str]:
        """Variables set before the engine of ``spec``'s role (None: this model's) starts (its EngineCore child
        inherits them)."""
        nice = self.settings.engine_nice
        return {NICE_ENV: str(nice)} if nice else {}

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        """``llm``'s: a request with media gets its final response's ``timings`` with ``cached_tokens`` (prompt
        tokens vLLM's prefix cache covered: ``usage.prompt_tokens_details`` of the OpenAI endpoint)."""
        return replace(request, timings=request.timings or {}) if request.items else request

    def answer_lookup(self, sender, params: dict, tag: bool) -> bool:
        """Answer the request if it is a lookup of held embeddings (``HELD_PARAMETER``); False: it is not one."""
        return False

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            params = request_parameters(request)
            tag = bool(params.get(ERROR_CODES_PARAMETER))
            if in_band_cancel(sender, params, self.cancels, tag) or self.answer_lookup(sender, params, tag):
                continue
            if params.get(LOAD_PARAMETER):  # a router's health and load probe (orchestrator.replicas)
                answer_json(sender, {"kv_cache_usage": self.engine_metrics.kv_cache_usage})
                continue
            try:
                parsed = parse_generate_request(read_generate_inputs(request), self.resolver, self.limits)
            except Exception as exc:
                send_error(sender, exc, tag)
                continue
            finally:
                self.metrics.media_decodes(decode_counter.count)
            request_id, sink = watched_sink(request, sender, self.cancels, tag, self.metrics)
            self.host.submit(self.cancels.tracking(request_id, stream_generation(
                self.host, parsed, sink, self.metrics, prepare=self.prepare, interval=self.stream_interval)))
        return None

    def finalize(self) -> None:
        report_a_slow_finalize()
        if self.openai is not None:
            self.openai.close()
        self.host.shutdown()
        self.cancels.close()
        # Metric families must go while the stub's shared memory is alive (else a segfault at exit); the
        # engine's stat logger may still hold engine_metrics, so its metrics are freed explicitly.
        self.metric_batch.close()
        self.engine_metrics.close()
        self.metrics.close()
        del self.metrics, self.engine_metrics, self.metric_batch
        # what a subclass's finalize does after this, and the stub's teardown, are bounded too
        bound_the_exit()


def kv_consumer_request(request: GenerateRequest, timings: dict | None = None) -> GenerateRequest:
    """A KV consumer's (decode's) engine request of a metadata-only one: the layouts' grids (and fields) only, with
    zeros for embeddings where this vLLM needs a tensor (``takes_layout_only``): the KV covers the media positions."""
    from backend.transfer.engine_inputs import (media_grids, media_kwargs, media_uuids,  # torch, as initialize's
                                                placeholder_media_embeds)

    zeros = {} if takes_layout_only() else placeholder_media_embeds(request.items)
    grids = {name: (zeros.get(name), grid) for name, grid in media_grids(request.items).items()}
    return replace(request, items=(), media_embeds=grids, media_kwargs=media_kwargs(request.items),
                   media_uuids=media_uuids(request.items), timings=timings or None)


class MetadataOnlyModel(GenerateModel):
    """A vLLM model fed metadata-only media (``image_layouts``), as its role's spec says (``self.spec``):
    ``pd`` and ``prefill`` pull each item's embeddings before submitting (``pulls_embeddings``); ``decode`` submits
    the layout alone, since the KV it receives already covers the media positions. Nothing is submitted whose
    embeddings are not here: a failed pull fails that request with UNAVAILABLE. ``prefill`` and ``decode`` also take
    media (``takes_media``: P/D, an orchestrator that skips the encoders), which their engine then processes.
    A ``kv_role`` gives the engine vLLM's NixlConnector in that role."""

    ROLE = Stage.PD

    def initialize(self, args):
        super().initialize(args)
        self.held = None  # this consumer's copies of what it pulled (backend.transfer.held)
        if self.spec.pulls_embeddings:
            # torch: imported after EngineHost.start's prepare_process set the process's thread and offline defaults
            from backend.transfer.consumer import EmbeddingConsumer
            from backend.transfer.held import HeldEmbeddings

            self.consumer = EmbeddingConsumer(role=self.name)
            settings = self.settings  # a consumer's settings are HeldSettings too (pd, prefill, colocated)
            self.held = HeldEmbeddings(settings.held_bytes, settings.session_seconds, settings.session_bytes) \
                if settings.held_bytes or (settings.session_seconds and settings.session_bytes) else None
            self.pulls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedding-pull")  # one agent user
            # connect to this server's encoders ahead of the first pull, on the pulls' thread
            self.producers = ProducerWatcher(directory(), lambda handle: self.pulls.submit(self.consumer.warm, handle))

    def make_resolver(self):
        identity, width = model_identity(self.engine_args["model"]), embedding_width(self.engine_args["model"])
        if self.spec.takes_media:
            return LayoutOrDecodeMedia(identity, self.limits.media, width)
        return LayoutMedia(identity, width)

    def engine_args_from(self, model_json):
        return self.with_session_kv(self.with_kv_role(metadata_only_engine_args(model_json), self.spec))

    def with_session_kv(self, engine_args: dict[str, Any]) -> dict[str, Any]:
        """``engine_args`` with the connector that keeps conversations' KV (``backend.engine.session_kv``) where the
        reuse settings ask for it (``session_kv_bytes`` and ``session_seconds``): pd's engine, and prefill's beside
        its NIXL connector (vLLM's MultiConnector)."""
        settings = self.settings  # a consumer's are HeldSettings; decode's (no copies) are not
        if not (self.spec.pulls_embeddings and getattr(settings, "session_kv_bytes", 0) and settings.session_seconds):
            return engine_args
        from backend.engine.session_kv import with_session_connector

        return {**engine_args, "kv_transfer_config": with_session_connector(
            engine_args.get("kv_transfer_config"), settings.session_kv_bytes, settings.session_seconds)}

    def with_kv_role(self, engine_args: dict[str, Any], spec: RoleSpec) -> dict[str, Any]:
        """``engine_args`` with vLLM's NixlConnector in ``spec``'s KV role (none: as they are)."""
        if not spec.kv_role:
            return engine_args
        return {**engine_args, "kv_transfer_config": kv_transfer_config(spec.kv_role, self.on_gpu,
                                                                         self.settings.kv_lease_seconds)}

    def process_env(self, spec: RoleSpec | None = None):
        """``spec``: the role of the engine about to start (None: this model's, ``self.spec``)."""
        spec = spec or self.spec
        if not spec.kv_role:
            return super().process_env(spec)
        settings: KvEngineSettings = self.settings  # a kv_role's model reads KvEngineSettings (or a subclass)
        port = settings.nixl_side_channel_port if settings.nixl_side_channel_port is not None else free_ports()[0]
        # EngineCore: after a step that ran no model, wait up to this long for new input (patch_idle_wait)
        wait = settings.engine_idle_wait_ms if settings.engine_idle_wait_ms is not None else spec.idle_wait_ms
        return {**super().process_env(), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port), "VLLM_NIXL_SIDE_CHANNEL_HOST": os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"),
                POLL_DELAY_ENV: str(settings.nixl_poll_delay_us),
                "EPD_ENGINE_IDLE_WAIT_MS": "" if wait is None else f"{wait:g}",
                "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}

    async def prepare(self, request: GenerateRequest, spec: RoleSpec | None = None) -> GenerateRequest:
        """``spec``: the role of the engine the request is for (None: this model's; E/P/D's decode in a colocated
        orchestrator's process passes decode's)."""
        spec = spec or self.spec
        layouts = sum(isinstance(item, LayoutMetadata) for item in request.items)
        if layouts < len(request.items):  # media decoded here (takes_media): the engine processes them
            if layouts:
                raise InvalidInput("messages", "give media either as media or as layouts (image_layouts, "
                                               "video_layouts, audio_layouts), not both")
            return request
        if not request.items:
            return request
        timings = {}
        if request.original_media:  # metadata-only off: do the media work a naive EPD consumer does
            seconds = process_original_media(request.original_media, request.items, self.image_processor(),
                                             self.limits.media, self.video_processor(), self.feature_extractor(),
                                             request.media_io)
            self.metrics.media_decodes(decode_counter.count)
            timings["media_ms"] = round(seconds * 1000, 3)
        from backend.transfer.engine_inputs import media_kwargs, media_uuids  # torch, as initialize's

        if not spec.pulls_embeddings:  # a KV consumer: its KV covers the media positions
            return kv_consumer_request(request, timings)

        started = time.perf_counter()
        embeds, taken = await asyncio.get_running_loop().run_in_executor(self.pulls, self._pull, request)
        seconds = time.perf_counter() - started
        pulled = [layout for layout, held in zip(request.items, taken) if not held]
        timings.update(transfer_ms=round(seconds * 1000, 3), transfer_bytes=sum(layout.handle.nbytes for layout in pulled))
        self.metrics.transferred(timings["transfer_bytes"], seconds, dict(self.consumer.paths))
        if self.held is not None:
            timings["held_taken"] = sum(taken)
            self.metrics.held(sum(taken), self.held.nbytes)
        return replace(request, items=(), media_embeds=embeds, media_kwargs=media_kwargs(request.items),
                       media_uuids=media_uuids(request.items), timings=timings)

    def _pull(self, request: GenerateRequest):
        """On the pulls' thread: the request's embeddings (its items this consumer holds taken from its copies,
        ``backend.transfer.held``) and, per item, whether it was taken so."""
        from backend.transfer.engine_inputs import pull_media_embeds  # torch, as initialize's

        layouts, held, session = request.items, self.held, request.session_id
        copies = [held.take(layout, session) for layout in layouts] if held is not None else [None] * len(layouts)
        return pull_media_embeds(self.consumer, layouts, copies, held, session), [c is not None for c in copies]

    def answer_lookup(self, sender, params, tag):
        if HELD_PARAMETER not in params:
            return False
        answer_held_lookup(sender, params[HELD_PARAMETER], self.held, tag)
        return True

    def image_processor(self):
        """The checkpoint's image processor (None: it has none), loaded at the first request with ``original_media``."""
        return self._processor("AutoImageProcessor")

    def feature_extractor(self):
        """The checkpoint's audio feature extractor (None: it has none), loaded as ``image_processor``."""
        return self._processor("AutoFeatureExtractor") if self.limits.media.audio_sampling_rate else None

    def _processor(self, auto: str):
        loaded = self.__dict__.setdefault("_processors", {})
        if auto not in loaded:
            import transformers

            try:
                loaded[auto] = getattr(transformers, auto).from_pretrained(self.engine_args["model"])
            except (OSError, ValueError):
                loaded[auto] = None
        return loaded[auto]

    def video_processor(self):
        """The checkpoint's video processor (None: it has none), loaded at the first request with ``original_media``."""
        if not hasattr(self, "_video_processor"):
            from backend.encode.encoder import load_video_processor  # torch, as initialize's

            self._video_processor = load_video_processor(Path(self.engine_args["model"]))
        return self._video_processor

    def finalize(self):
        super().finalize()
        if self.spec.pulls_embeddings:
            self.producers.close()
            self.pulls.shutdown(wait=True)
            self.consumer.close()  # sends the releases still queued

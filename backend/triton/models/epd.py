"""``epd``: the orchestrator (decoupled). Same Triton interface as ``llm``; media go to the
``encoder`` model, the metadata-only request goes to ``pd`` (topology E+PD) or to ``prefill`` then
``decode`` (topology E/P/D), whose stream comes back to the client. Model parameters:
``backend.protocol.settings.ProxySettings``.
Adapter only: the logic is ``orchestrator.core``.
"""
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.encode.checkpoint import model_identity, processing_options
from backend.engine.host import bound_the_exit, prepare_process
from backend.engine.loop import LoopThread, watch_lag
from backend.protocol.modality import modalities
from backend.request.media import MediaLimits, media_limits
from backend.request.generate import RequestLimits
from backend.protocol.settings import ProxySettings
from orchestrator.cancel_board import CancelBoard
from backend.triton.config import in_process_endpoint, instance_count, load_settings
from backend.triton.counter_batch import after_load
from backend.triton.io import orchestrate
from backend.triton.metrics import RequestMetrics
from orchestrator.admission import Admission
from orchestrator.core import Identity, Orchestrator
from backend.deploy.server_address import EndpointError
from backend.triton.stage_client import encoder_urls, stage_urls, triton_stages


@after_load
class TritonPythonModel:
    def initialize(self, args):
        prepare_process()
        if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
            raise pb_utils.TritonModelException("epd must use the decoupled transaction policy")
        settings = load_settings(ProxySettings, args)
        model_dir = (Path(args["model_repository"]) / settings.model).resolve()
        limits = RequestLimits(
            **{m.limit_field: getattr(settings, m.limit_field) for m in modalities()},
            media=MediaLimits(**media_limits(settings),
                              allowed_local_media_path=settings.allowed_local_media_path,
                              allowed_media_domains=tuple(d.lower() for d in settings.allowed_media_domains)),
            priority_levels=settings.priority_levels)
        disaggregation = settings.disaggregation
        try:
            urls = stage_urls(settings.targets(), disaggregation.generators)
            encoders = encoder_urls(settings.encoder_model, settings.encoder_endpoint)
        except EndpointError as exc:
            raise pb_utils.TritonModelException(f"{args['model_name']}: {exc}") from None
        self.metrics = RequestMetrics(args["model_name"], instance=args.get("model_instance_name", ""))
        self.stages = triton_stages(urls, settings.encoder_model, settings.generator_model, settings.prefill_model,
                                    settings.decode_model, encoders, settings.health_seconds())
        self.orchestrator = Orchestrator(self.stages, Identity(model_identity(model_dir), processing_options(model_dir)),
                                         limits, disaggregation, metadata_only=settings.metadata_only,
                                         deadline=settings.request_timeout_seconds,
                                         stages_take_media=disaggregation.generators_take_media,
                                         video_split=settings.video_split, demand_aware=settings.demand_aware,
                                         admission=Admission(settings, self.metrics))
        self.loop = LoopThread("epd-loop")
        self.watch = self.loop.submit(self.stages.watch())  # logs whether the stages answer at their addresses
        self.lag = self.loop.submit(watch_lag(self.metrics.loop_lag))  # epd_loop_lag_seconds
        self.cancels = CancelBoard.for_model(args["model_name"])
        self.openai = None
        if settings.openai_port:  # the OpenAI endpoint in this process (frontend.openai.in_process)
            serve_for = in_process_endpoint("openai")  # frontend.openai.in_process, plugged in (no upward import)
            self.openai = serve_for(args["model_name"], settings, self.orchestrator.answerer(self.metrics),
                                    self.loop.submit, self.metrics, instance_count(json.loads(args["model_config"])),
                                    str(model_dir))

    def execute(self, requests):
        orchestrate(requests, self.orchestrator, self.metrics, self.loop.submit, self.cancels)
        return None

    def finalize(self):
        if self.openai is not None:
            self.openai.close()
        self.watch.cancel()
        self.lag.cancel()
        try:
            self.loop.submit(self.stages.aclose()).result(timeout=5)
        except Exception as exc:  # noqa: BLE001 - unloading anyway
            pb_utils.Logger.log_warn(f"epd: closing the stage client: {exc}")
        self.loop.stop()
        self.cancels.close()
        self.metrics.close()  # pending counts, while the stub's shared memory is alive
        del self.metrics
        bound_the_exit()  # what comes after finalize, bounded (backend.engine.host.bound_the_exit)

"""``epd``: the orchestrator (decoupled). Same Triton interface as ``llm``; media go to the
``encoder`` model, the metadata-only request goes to ``pd`` (topology E+PD) or to ``prefill`` then
``decode`` (topology E/P/D), whose stream comes back to the client. Model parameters:
``backend.protocol.settings.ProxySettings``.
Adapter only: the logic is ``ensemble.orchestrator``.
"""
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.encode.checkpoint import model_identity, processing_options
from backend.engine.host import prepare_process
from backend.engine.loop import LoopThread
from backend.protocol.modality import modalities
from backend.request.media import MediaLimits, media_limits
from backend.request.generate import RequestLimits
from backend.protocol.errors import InvalidInput
from backend.protocol.settings import ProxySettings
from backend.triton.cancel_board import CancelBoard
from backend.triton.config import instance_count, load_settings
from backend.triton.io import (ERROR_CODES_PARAMETER, in_band_cancel, read_generate_inputs, request_parameters, send_error,
                               watched_sink)
from backend.triton.metrics import RequestMetrics
from ensemble.orchestrator import Identity, Orchestrator
from backend.deploy.server_address import EndpointError
from backend.triton.stage_client import TritonStages, encoder_urls, stage_urls
from backend.protocol.generate import ENCODE_PARAMETER, DEMAND_AWARE_PARAMETER, METADATA_ONLY_PARAMETER


def _bool_parameter(params: dict, name: str) -> bool | None:
    value = params.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"parameters.{name}", f"expected a bool, got {value!r}")
    return value


def orchestrate(requests, orchestrator: Orchestrator, metrics, submit, cancels: CancelBoard) -> None:
    """``execute`` of the orchestrator models (this one and ``backend.triton.models.colocated``): read each request
    (a bad one is answered with its error at once; an in-band cancel cancels on ``cancels``) and ``submit``
    the orchestrator's run of it to the model's event loop."""
    for request in requests:
        sender = request.get_response_sender()
        params = request_parameters(request)
        tag = bool(params.get(ERROR_CODES_PARAMETER))  # clients may ask for "[CODE] " before messages, as stages do
        if in_band_cancel(sender, params, cancels, tag):
            continue
        try:
            raw = read_generate_inputs(request)
            options = run_options(params)
        except Exception as exc:
            send_error(sender, exc, tag)
            continue
        request_id, sink = watched_sink(request, sender, cancels, tag, metrics)
        submit(cancels.tracking(request_id, orchestrator.run(raw, sink, metrics, *options)))


def run_options(params: dict) -> tuple[bool | None, bool, bool | None]:
    """``Orchestrator.run``'s options from a request's parameters: metadata-only, encode, demand-aware."""
    return (_bool_parameter(params, METADATA_ONLY_PARAMETER), _bool_parameter(params, ENCODE_PARAMETER) is not False,
            _bool_parameter(params, DEMAND_AWARE_PARAMETER))


def answerer(orchestrator: Orchestrator, metrics):
    """The in-process OpenAI endpoint's request function (``frontend.openai.in_process``) of an orchestrator model:
    ``orchestrate`` for one request given as values, its bad parameters sent to the sink as its error."""
    async def answer(raw, params: dict, sink) -> None:
        try:
            options = run_options(params)
        except Exception as exc:
            sink.send_error(exc)
            return
        await orchestrator.run(raw, sink, metrics, *options)
    return answer


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
                              allowed_media_domains=tuple(d.lower() for d in settings.allowed_media_domains)))
        mode = settings.topology
        try:
            urls = stage_urls(settings.targets(), mode.generators)
            encoders = encoder_urls(settings.encoder_model, settings.encoder_endpoint)
        except EndpointError as exc:
            raise pb_utils.TritonModelException(f"{args['model_name']}: {exc}") from None
        self.stages = TritonStages(urls, settings.encoder_model, settings.generator_model, settings.prefill_model,
                                   settings.decode_model, encoders, settings.health_seconds())
        self.orchestrator = Orchestrator(self.stages, Identity(model_identity(model_dir), processing_options(model_dir)),
                                         limits, mode, deadline=settings.request_timeout_seconds,
                                         metadata_only=settings.metadata_only,
                                         stages_take_media=mode.generators_take_media,
                                         video_split=settings.video_split, demand_aware=settings.demand_aware)
        self.metrics = RequestMetrics(args["model_name"], instance=args.get("model_instance_name", ""))
        self.loop = LoopThread("epd-loop")
        self.watch = self.loop.submit(self.stages.watch())  # logs whether the stages answer at their addresses
        self.cancels = CancelBoard.for_model(args["model_name"])
        self.openai = None
        if settings.openai_port:  # the OpenAI endpoint in this process (frontend.openai.in_process)
            # upward on purpose: the endpoint served inside this process (fastapi), imported only where configured
            from frontend.openai.in_process import serve_for

            self.openai = serve_for(args["model_name"], settings, answerer(self.orchestrator, self.metrics),
                                    self.loop.submit, self.metrics, instance_count(json.loads(args["model_config"])))

    def execute(self, requests):
        orchestrate(requests, self.orchestrator, self.metrics, self.loop.submit, self.cancels)
        return None

    def finalize(self):
        if self.openai is not None:
            self.openai.close()
        self.watch.cancel()
        try:
            self.loop.submit(self.stages.aclose()).result(timeout=5)
        except Exception as exc:  # noqa: BLE001 - unloading anyway
            pb_utils.Logger.log_warn(f"epd: closing the stage client: {exc}")
        self.loop.stop()
        self.cancels.close()
        self.metrics.close()  # pending counts, while the stub's shared memory is alive
        del self.metrics

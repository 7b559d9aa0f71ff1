"""``epd``: the orchestrator (decoupled). Same Triton interface as ``llm``; media go to the
``encoder`` model, the metadata-only request goes to ``pd`` (topology E+PD) or to ``prefill`` then
``decode`` (topology E/P/D), whose stream comes back to the client.
Adapter only: the logic is ``ensemble.orchestrator``.
"""
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.encode.checkpoint import model_identity, processing_options
from backend.engine.host import prepare_process
from backend.triton.generate_model import parameter
from backend.engine.loop import LoopThread
from backend.request.media import MediaLimits
from backend.request.generate import RequestLimits
from backend.protocol.errors import InvalidInput
from backend.triton.cancel_board import CancelBoard
from backend.triton.io import (ERROR_CODES_PARAMETER, in_band_cancel, read_generate_inputs, request_parameters, send_error,
                               watched_sink)
from backend.triton.metrics import RequestMetrics
from ensemble.orchestrator import Identity, Orchestrator, Stage, Topology
from backend.deploy.server_address import EndpointError
from backend.triton.stage_client import TritonStages, stage_urls
from backend.protocol.generate import ENCODE_PARAMETER, METADATA_ONLY_PARAMETER


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
            metadata_only = _bool_parameter(params, METADATA_ONLY_PARAMETER)
            encode = _bool_parameter(params, ENCODE_PARAMETER) is not False
        except Exception as exc:
            send_error(sender, exc, tag)
            continue
        request_id, sink = watched_sink(request, sender, cancels, tag, metrics)
        submit(cancels.tracking(request_id, orchestrator.run(raw, sink, metrics, metadata_only, encode)))


class TritonPythonModel:
    def initialize(self, args):
        prepare_process()
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("epd must use the decoupled transaction policy")
        model_dir = (Path(args["model_repository"]) / parameter(config, "model", "")).resolve()
        limits = RequestLimits(
            max_images=int(parameter(config, "max_images", "4")),
            media=MediaLimits(max_image_pixels=int(parameter(config, "max_image_pixels", "16000000")),
                              max_item_bytes=int(parameter(config, "max_item_bytes", str(32 << 20))),
                              allowed_local_media_path=parameter(config, "allowed_local_media_path", ""),
                              allowed_media_domains=tuple(d.strip().lower() for d in parameter(
                                  config, "allowed_media_domains", "").split(",") if d.strip())))
        topology = Topology(parameter(config, "topology", "E+PD"))
        roles = (Stage.GENERATE,) if topology is Topology.E_PD else (Stage.PREFILL, Stage.DECODE)
        try:
            urls = stage_urls(lambda name, default: parameter(config, name, default), roles)
        except EndpointError as exc:
            raise pb_utils.TritonModelException(f"{args['model_name']}: {exc}") from None
        self.stages = TritonStages(urls, parameter(config, "encoder_model", "encoder"), parameter(config, "generator_model", "pd"),
                                   parameter(config, "prefill_model", "prefill"), parameter(config, "decode_model", "decode"))
        self.orchestrator = Orchestrator(self.stages, Identity(model_identity(model_dir), processing_options(model_dir)),
                                         limits, topology, deadline=float(parameter(config, "request_timeout_seconds", "300")),
                                         metadata_only=parameter(config, "metadata_only", "true").lower() != "false",
                                         stages_take_media=topology is Topology.E_P_D)
        self.metrics = RequestMetrics(args["model_name"], instance=args.get("model_instance_name", ""))
        self.loop = LoopThread("epd-loop")
        self.watch = self.loop.submit(self.stages.watch())  # logs whether the stages answer at their addresses
        self.cancels = CancelBoard.for_model(args["model_name"])

    def execute(self, requests):
        orchestrate(requests, self.orchestrator, self.metrics, self.loop.submit, self.cancels)
        return None

    def finalize(self):
        self.watch.cancel()
        try:
            self.loop.submit(self.stages.aclose()).result(timeout=5)
        except Exception as exc:  # noqa: BLE001 - unloading anyway
            pb_utils.Logger.log_warn(f"epd: closing the stage client: {exc}")
        self.loop.stop()
        self.cancels.close()
        self.metrics.close()  # pending counts, while the stub's shared memory is alive
        del self.metrics

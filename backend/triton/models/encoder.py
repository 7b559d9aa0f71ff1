"""``encoder``: decode, preprocess and encode images and videos (or audio); publish embeddings as NIXL leases.

Adapter only: ``backend.encode.service.EncoderService`` does the work for all items Triton batched together.
On ``KIND_GPU`` the tower runs on the instance's GPU. A request whose ``epd_part`` parameter is ``"i/n"``
(``backend.protocol.generate.PART_PARAMETER``) asks for part i of n of its video. Model parameters: ``backend.protocol.settings.EncoderSettings``
(``encoder_impl``, ``encoder_dtype``, ``encoder_compile``, ``encoder_cuda_graphs``, ``cache_bytes``, the pool's size and lease times, ...).
With ``tier_bytes`` (or ``tier_master``) set, every instance connects at load to the shared embedding tier the launcher
started (``backend.deploy.tier_service.launch_for``; its addresses in ``EPD_TIER_MASTER`` / ``EPD_TIER_METADATA``) and
the service reads it on a cache miss and writes it after an encode (docs/tier.md); a tier that cannot be reached is
logged once and the instance encodes without it.
"""
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from backend.deploy.tier_service import MASTER_ENV, METADATA_ENV, mooncake_paths
from backend.encode import gpu_image
from backend.encode.checkpoint import processing_options
from backend.encode.cuda_wait import block_on_waits
from backend.encode.encoder import load_encoder
from backend.encode.service import EncodeJob, EncoderService
from backend.encode.tier import TierUnavailable
from backend.encode.tier_mooncake import connect  # mooncake itself is imported when a store is made
from backend.engine.host import bound_the_exit, prepare_process
from backend.protocol.errors import DeadlineExceeded
from backend.protocol.generate import ENCODER_ITEM, ENCODER_KEY, ENCODER_LAYOUT, ENCODER_MODALITY, PART_PARAMETER, \
    parse_deadline, parse_part
from backend.protocol.layout import content_key
from backend.protocol.media_options import MediaOptions
from backend.protocol.modality import IMAGE
from backend.protocol.settings import EncoderSettings, ImagePreprocess, VideoDecoder
from backend.request import image, nvdec
from backend.request.generate import checkpoint_media
from backend.request.media import MediaLimits, media_limits
from backend.request.video import VIDEO_DECODES
from backend.transfer.announce import announce, directory, withdraw
from backend.transfer.producer import EmbeddingPool
from backend.triton.config import load_settings
from backend.triton.counter_batch import after_load, wait_until_loaded
from backend.triton.io import request_parameters, to_triton_error, wants_error_codes
from backend.triton.metrics import EncoderMetrics

METRICS_SECONDS = 1.0


def nvdec_device(settings: EncoderSettings, device: str) -> int:
    """The GPU videos are decoded on (``video_decoder: nvdec``: this instance's; its decoder made now, so a missing
    PyNvVideoCodec fails the load, not a request), -1 for the CPU."""
    if settings.video_decoder != VideoDecoder.NVDEC:
        return -1
    if not device.startswith("cuda"):
        raise pb_utils.TritonModelException("encoder: video_decoder nvdec decodes on the instance's GPU: it needs "
                                            "KIND_GPU instances")
    index = torch.device(device).index or 0
    try:
        nvdec.decoder(index)
    except ImportError as exc:
        raise pb_utils.TritonModelException(f"encoder: video_decoder nvdec needs PyNvVideoCodec ({exc})") from None
    return index


def image_device(settings: EncoderSettings, device: str, encoder) -> dict:
    """``MediaLimits``' image fields: with ``image_preprocess`` gpu or nvjpeg, images come as uint8 tensors on this
    instance's GPU (``backend.encode.gpu_image``; the load fails where the instance is not on a GPU or its processor
    is not one that module reproduces); nvjpeg's decoder is set up now on a small JPEG, not by a request."""
    if settings.image_preprocess == ImagePreprocess.CPU:
        return {}
    if not device.startswith("cuda"):
        raise pb_utils.TritonModelException(f"encoder: image_preprocess {settings.image_preprocess} preprocesses on the "
                                            "instance's GPU: it needs KIND_GPU instances")
    processor = getattr(encoder, "processor", None)
    if processor is None or not gpu_image.supported(processor):
        raise pb_utils.TritonModelException(f"encoder: image_preprocess {settings.image_preprocess} does not reproduce "
                                            f"{type(processor).__name__}; use image_preprocess: cpu")
    if settings.image_preprocess == ImagePreprocess.NVJPEG:
        image.nvjpeg_decode(image.sample_jpeg(), torch.device(device))
    return {"image_device": device, "nvjpeg": settings.image_preprocess == ImagePreprocess.NVJPEG}


def _response(request, shape, result):
    """A request's answer: its layouts, or its failure as a Triton error."""
    if isinstance(result, BaseException):
        return pb_utils.InferenceResponse(error=to_triton_error(result, wants_error_codes(request)))
    layouts = np.array([s.encode() for s in result], dtype=np.object_).reshape(shape)
    return pb_utils.InferenceResponse([pb_utils.Tensor(ENCODER_LAYOUT.name, layouts)])


@after_load
class TritonPythonModel:
    def initialize(self, args):
        prepare_process()
        settings = load_settings(EncoderSettings, args)
        model_dir = Path(args["model_repository"]) / settings.model
        device = f"cuda:{args['model_instance_device_id']}" if args["model_instance_kind"] == "GPU" else "cpu"
        dtype = settings.encoder_dtype  # "" = the checkpoint's; bfloat16 for speed on GPU
        if settings.cuda_blocking_sync and device.startswith("cuda"):  # before this process's first CUDA tensor
            sleeping = block_on_waits(int(args["model_instance_device_id"]))
            pb_utils.Logger.log_info(f"encoder: waits for the GPU {'sleep' if sleeping else 'spin (not changed)'}")
        # the checkpoint's vision tower, or an audio-only checkpoint's audio tower (backend.encode.audio)
        self.encoder = load_encoder(model_dir.resolve(), device=device, dtype=getattr(torch, dtype) if dtype else None,
                                    impl=settings.encoder_impl, compile=settings.encoder_compile,
                                    cuda_graphs=settings.encoder_cuda_graphs)
        self.processing = processing_options(model_dir)
        if settings.image_preprocess == ImagePreprocess.NVJPEG:  # its JPEGs' embeddings are not the CPU path's
            self.processing += "+nvjpeg"
        self.pool = EmbeddingPool(settings.pool_bytes, lease_seconds=settings.lease_seconds,
                                  alloc_timeout=settings.alloc_timeout_seconds,
                                  device=device)  # on KIND_GPU the leases live in the instance's VRAM
        limits = MediaLimits(**media_limits(settings), **checkpoint_media(model_dir.resolve()),
                             nvdec_device=nvdec_device(settings, device),
                             **image_device(settings, device, self.encoder))
        self.service = EncoderService(self.encoder, self.pool, limits, self.processing, cache_bytes=settings.cache_bytes)
        # The first processor call and tower forward cost 3-5x a later one (measured: 46 ms against 9 for the
        # first epd request's item): VisionEncoder.load paid that, on an image and a video nobody asked for
        # (check_width), not a request; warm_up compiles a compiled tower's blocks; the service's warm-up decodes a
        # small item of each modality (the first video's decode imported vLLM's loader: 8.7 s on the H200).
        self.encoder.warm_up()
        self.service.warm_up()
        self.announcement = announce(self.pool.pool_handle(), directory())  # consumers here connect ahead
        # last: nothing may fork this process once it holds a Mooncake client (docs/tier.md)
        self.service.tier = self.tier = connect_tier(settings)
        self.metrics = EncoderMetrics(args["model_name"], args.get("model_instance_name", ""),
                                      tier=bool(settings.tier_bytes or settings.tier_master))
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report, name="encoder-metrics", daemon=True)
        self._reporter.start()
        report = self.encoder.load_report
        pb_utils.Logger.log_info(
            f"encoder: tower loaded in {report.seconds * 1000:.0f} ms, read {report.bytes_read} of "
            f"{report.checkpoint_bytes} checkpoint bytes; model {self.encoder.identity}")

    deadline_stops = 0  # requests refused unencoded: their deadline had passed (epd_encoder_deadline_stops_total)

    def execute(self, requests):
        jobs, shapes, refused = [], [], {}
        for index, request in enumerate(requests):
            items = pb_utils.get_input_tensor_by_name(request, ENCODER_ITEM.name).as_numpy()  # of any modality
            shapes.append(items.shape)
            try:
                params = request_parameters(request)
                part = parse_part(params[PART_PARAMETER]) if PART_PARAMETER in params else None
                options = MediaOptions.from_parameters(params)
                deadline = parse_deadline(params, time.time())
                if deadline is not None and time.time() >= deadline:  # its orchestrator has answered it already
                    self.deadline_stops += 1
                    raise DeadlineExceeded("the deadline passed before the encoder started it", "request")
            except Exception as exc:  # noqa: BLE001 - fails this request only
                refused[index] = exc
                continue
            keys = pb_utils.get_input_tensor_by_name(request, ENCODER_KEY.name)
            keys = keys.as_numpy().reshape(-1) if keys is not None else [None] * items.shape[0]
            kinds = pb_utils.get_input_tensor_by_name(request, ENCODER_MODALITY.name)
            kinds = [k.decode() if k else IMAGE.name for k in kinds.as_numpy().reshape(-1)] if kinds is not None else \
                [IMAGE.name] * items.shape[0]
            for data, key, kind in zip(items.reshape(-1), keys, kinds):
                data, how = bytes(data), options.key(kind)
                if isinstance(key, bytes) and key:
                    jobs.append(EncodeJob(index, data, key.decode(), modality=kind, part=part, options=how))
                else:  # computed here from the bytes: the cache may use it as its own key
                    own = content_key(data, self.processing, self.encoder.identity, part, how)
                    jobs.append(EncodeJob(index, data, own, own_key=own, modality=kind, part=part, options=how))
        results = self.service.run(jobs, len(requests))
        try:
            return [_response(request, shape, refused.get(index, results[index]))
                    for index, (request, shape) in enumerate(zip(requests, shapes))]
        finally:
            # The failures' tracebacks reach this frame (the frame they were caught in, or their frames' caller),
            # which holds them: a cycle with the batch's Triton requests that only the garbage collector frees, and
            # left to the interpreter's end their destructors reached into the stub's shared memory, gone by then
            # (SIGSEGV of encoder stubs at stops; core dumps, test_families 2026-12-06). Emptied, nothing is held.
            refused.clear()
            results.clear()

    def _report(self) -> None:
        if not wait_until_loaded(self._stop):  # no metric call before initialize has returned; then one at once
            return
        while True:
            try:
                self.metrics.refresh(self.service.items_encoded, self.service.encode_seconds, self.pool.stats(),
                                     self.service.cache_hits, self.tier, self.service.tier_hits,
                                     dict(VIDEO_DECODES), dict(image.IMAGE_DECODES), self.deadline_stops)
            except Exception as exc:  # noqa: BLE001 - metrics must not take the encoder down
                pb_utils.Logger.log_warn(f"encoder metrics: {exc}")
            if self._stop.wait(METRICS_SECONDS):
                return

    def finalize(self):
        withdraw(self.announcement)
        self._stop.set()
        self._reporter.join(timeout=5)
        del self.metrics  # metric families must go while the stub's shared memory is alive
        if self.tier is not None:
            self.tier.close()
        self.pool.close()
        bound_the_exit()  # what comes after finalize once hung for good (backend.engine.host.bound_the_exit)


def connect_tier(settings: EncoderSettings):
    """The shared embedding tier of these settings (``backend.encode.tier.EmbeddingTier``), or None: none configured,
    or it cannot be had (logged, with the reason: the instance encodes without it)."""
    if not (settings.tier_bytes or settings.tier_master):
        return None
    master = settings.tier_master or os.environ.get(MASTER_ENV, "")
    metadata = settings.tier_metadata or os.environ.get(METADATA_ENV, "")
    paths = mooncake_paths()
    try:
        if not (master and metadata):
            raise TierUnavailable(f"no tier address ({MASTER_ENV} unset: the server was not started by "
                                  "backend.deploy.local_server, or Mooncake is not installed)")
        tier = connect(master, metadata, site_packages=paths[0] if paths else None,
                       call_timeout=settings.tier_call_timeout_seconds, retry_seconds=settings.tier_retry_seconds,
                       claim_seconds=settings.tier_claim_seconds)
    except TierUnavailable as exc:
        pb_utils.Logger.log_warn(f"encoder: embedding tier unavailable, encoding without it: {exc}")
        return None
    pb_utils.Logger.log_info(f"encoder: embedding tier connected (master {master})")
    return tier

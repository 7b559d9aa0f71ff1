"""NVDEC in the encoder's video decode (``backend.request.nvdec``, ``video_decoder: nvdec``) on a real GPU: the frames
``decode_video`` gives (in VRAM) equal the CPU path's bit for bit, on H.264 clips untagged and tagged, at 448 px and
720p, from several threads at once (more than the decoders kept), and what each path costs; the video processor run
on them there against the host's; the served encoder.

Skipped without CUDA and PyNvVideoCodec (CI); run on the lent GPU machine (docs/gpu.md)."""
from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.component,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("PyNvVideoCodec") is None, reason="needs PyNvVideoCodec")]

BT709 = "colormatrix=bt709:colorprim=bt709:transfer=bt709"
BT601 = "colormatrix=smpte170m:colorprim=smpte170m:transfer=smpte170m"
CLIPS = {"112x112 untagged, noise": (112, 112, "", True), "448x448 untagged, noise": (448, 448, "", True), "1280x720 untagged, noise": (1280, 720, "", True),
         "1280x720 BT.709, noise": (1280, 720, BT709, True), "1280x720 BT.601, gradients": (1280, 720, BT601, False),
         "640x360 untagged, gradients": (640, 360, "", False)}


def _limits():
    from backend.request.media import MediaLimits

    return MediaLimits(video_processor="Qwen2VLVideoProcessor", max_item_bytes=256 << 20)


def _clip(width, height, tags, noise, seed=0):
    from clients.videos import make_h264_video

    return make_h264_video(width, height, frames=30, fps=30, seed=seed, tags=tags, noise=noise)


def _host(frames) -> np.ndarray:
    return frames.cpu().numpy() if isinstance(frames, torch.Tensor) else frames


def _median_ms(fn) -> float:
    from clients.tools.nvdec_probe import median_seconds

    return round(median_seconds(fn) * 1000, 2)


@pytest.mark.parametrize("name", list(CLIPS))
def test_nvdec_frames_are_the_cpu_path_s_bit_for_bit(name):
    from backend.request import video

    data = _clip(*CLIPS[name])
    limits = _limits()
    for options in ({}, {"fps": 10}, {"fps": 30}):
        want = video.decode_video(data, "video[0]", limits, **options)
        before = video.VIDEO_DECODES["nvdec"]
        got = video.decode_video(data, "video[0]", replace(limits, nvdec_device=0), **options)
        assert video.VIDEO_DECODES["nvdec"] == before + 1, "fell back to the CPU"
        assert got.frames.is_cuda and tuple(got.frames.shape) == want.frames.shape, options
        diff = np.abs(_host(got.frames).astype(int) - want.frames.astype(int))
        assert diff.max() == 0, (name, options, int(diff.max()), float(diff.mean()))
        assert got.metadata["frames_indices"] == want.metadata["frames_indices"]
    cpu = _median_ms(lambda: video.decode_video(data, "video[0]", limits, fps=30))
    gpu = _median_ms(lambda: video.decode_video(data, "video[0]", replace(limits, nvdec_device=0), fps=30))
    print(f"{name}: {len(data)} bytes, 30 frames: decode_video CPU {cpu} ms, NVDEC {gpu} ms ({cpu / gpu:.2f}x)")


def test_concurrent_videos_share_the_kept_decoders_and_stay_exact():
    from backend.request import nvdec, video

    limits = _limits()
    clips = [_clip(640, 360, "", False, seed) for seed in range(8)] + [_clip(448, 448, "", True, 9)]
    want = [video.decode_video(c, "video[0]", limits, fps=30).frames for c in clips]
    on_gpu = replace(limits, nvdec_device=0)
    with ThreadPoolExecutor(6) as pool:  # more threads than decoders kept (nvdec.SLOTS)
        got = list(pool.map(lambda c: _host(video.decode_video(c, "video[0]", on_gpu, fps=30).frames), clips * 2))
    for index, frames in enumerate(got):
        assert np.array_equal(frames, want[index % len(clips)]), index
    assert nvdec.decoder(0)._made <= nvdec.SLOTS


LEVEL = 1 / 255 / 0.26130258  # one level of a uint8 frame after Qwen2-VL's normalization (its smallest std)


@pytest.mark.parametrize("name", list(CLIPS))
def test_the_encoder_preprocesses_nvdec_frames_to_the_host_s_embeddings(name):
    """NVDEC's frames are preprocessed where they are (``VisionEncoder._preprocess_videos``) where that gives the
    host's pixels: frames the processor keeps at their size (448 px, a multiple of 28) give them to float rounding on
    the GPU; a resize goes through torchvision's antialiased bicubic, whose CUDA kernel computes in float where the
    host's is fixed-point uint8 (the processor's pixels on CUDA printed, levels apart), so those videos are
    preprocessed on the host. Either way the embeddings (fp32 tower on the GPU) equal the CPU path's."""
    from backend.encode.encoder import VisionEncoder
    from backend.request import video

    data = _clip(*CLIPS[name])
    limits = _limits()
    on_cpu = video.decode_video(data, "video[0]", limits)
    on_gpu = video.decode_video(data, "video[0]", replace(limits, nvdec_device=0))
    assert on_gpu.frames.is_cuda
    encoder = _gpu_encoder(VisionEncoder)
    host = encoder.video_processor(videos=[on_cpu.frames], return_tensors="pt")
    gpu = encoder.video_processor(videos=[on_gpu.frames], return_tensors="pt")
    assert gpu["pixel_values_videos"].is_cuda and torch.equal(gpu["video_grid_thw"], host["video_grid_thw"])
    levels = (gpu["pixel_values_videos"].cpu() - host["pixel_values_videos"]).abs() / LEVEL
    resized = not encoder.keeps_size(tuple(on_gpu.frames.shape))
    embeds = [encoder.encode([item])[0].embeddings for item in (on_cpu, on_gpu)]
    t, h, w = host["video_grid_thw"][0].tolist()
    print(f"{name}: grid {t}x{h}x{w}, resized {resized}: the processor on CUDA max {levels.max():.3f} levels, "
          f"{(levels > 0.5).float().mean():.4%} of values a level or more apart; embeddings equal "
          f"{torch.equal(embeds[0], embeds[1])}")
    if not resized:
        assert levels.max() <= 1e-3, (name, float(levels.max()))
    assert torch.equal(embeds[0], embeds[1]), name


_ENCODERS: dict = {}


def _gpu_encoder(cls):
    import os
    from pathlib import Path

    if "enc" not in _ENCODERS:
        root = Path(__file__).resolve().parents[2]
        model = Path(os.environ.get("EPD_GPU_SERVE_MODEL") or root / "models" / "tiny-qwen2-vl")
        _ENCODERS["enc"] = cls.load(model, device="cuda", dtype=torch.float32)
    return _ENCODERS["enc"]


def test_a_stream_the_exact_path_refuses_is_decoded_on_the_cpu():
    from backend.request import video
    from clients.videos import make_video

    # OpenCV's mp4v (MPEG-4 Part 2): NVDEC decodes it, but not to FFmpeg's frames (its IDCT is the standard's within
    # a tolerance), so it is decoded on the CPU
    data = make_video(128, 96, frames=12, fps=6)
    limits = _limits()
    before = dict(video.VIDEO_DECODES)
    got = video.decode_video(data, "video[0]", replace(limits, nvdec_device=0))
    assert video.VIDEO_DECODES["cpu"] == before.get("cpu", 0) + 1
    assert np.array_equal(got.frames, video.decode_video(data, "video[0]", limits).frames)


def test_videos_decoded_by_nvdec_in_the_served_encoder_give_llm_s_tokens(tmp_path):
    """``llm`` and ``epd`` of topologies/checkpoint-gpu.yaml through the real tritonserver, the encoder with
    ``video_decoder: nvdec``, in fp32: the same greedy tokens on H.264 videos; every video decoded by NVDEC
    (``epd_video_decodes_total{decoder}``), none downstream of the encoder."""
    import os
    from pathlib import Path

    from backend.deploy.local_server import TritonServer, triton_home
    from backend.deploy.render import render
    from backend.deploy.topology import load
    from backend.protocol.generate import GenerateInputs
    from clients.triton_client import generate_grpc
    from tests.e2e.conftest import metric

    try:
        triton_home()
    except FileNotFoundError:
        pytest.skip("needs tritonserver in .venv (scripts/gpu_triton_env.sh)")
    root = Path(__file__).resolve().parents[2]
    model = Path(os.environ.get("EPD_GPU_SERVE_MODEL") or root / "models" / "tiny-qwen2-vl")
    topology = load(root / "topologies" / "checkpoint-gpu.yaml", checkpoint=model).only(
        ("baseline", "E+PD"), engine_args={"dtype": "float32", "enforce_eager": True, "max_model_len": 4096,
                                           "kv_cache_memory_bytes": 4 << 30})
    topology = replace(topology, stages={**topology.stages, "encoder": replace(topology.stages["encoder"],
                                                                               video_decoder="nvdec")})
    render(topology, tmp_path / "repo")
    clips = [_clip(448, 448, "", False, 1), _clip(1280, 720, BT709, False, 2), _clip(640, 360, BT601, False, 3)]
    content = [{"type": "video"}, {"type": "text", "text": "what happens?"}]
    with TritonServer(tmp_path / "repo", log_path=tmp_path / "server.log") as server:
        for index, data in enumerate(clips):
            inputs = GenerateInputs(messages=[{"role": "user", "content": content}], videos=[data],
                                    sampling={"temperature": 0.0, "max_tokens": 16, "ignore_eos": True})
            llm = generate_grpc(server.grpc_url, "llm", inputs)
            got = generate_grpc(server.grpc_url, "epd", inputs)
            print(f"video {index}: llm TTFT {llm.ttft:.3f} s, epd TTFT {got.ttft:.3f} s, stages {got.timings}")
            assert (got.text, got.num_output_tokens) == (llm.text, 16), index
        time.sleep(2)  # the encoder's metrics are refreshed once a second
        decodes = {d: metric(server, "epd_video_decodes_total", model="encoder", decoder=d) for d in ("nvdec", "cpu")}
        print("encoder video decodes:", decodes)
        assert decodes == {"nvdec": len(clips), "cpu": 0}
        assert metric(server, "epd_media_decodes_total", model="pd") == 0


FIRST_VIDEO = r'''
import cProfile, io, pstats, sys, time
from backend.engine.host import prepare_process
prepare_process()  # the stub's settings (one intra-op thread)
import torch
from backend.encode.encoder import load_encoder
from backend.encode.service import EncodeJob, EncoderService
from backend.request import nvdec
from backend.request.generate import checkpoint_media
from backend.request.media import MediaLimits
from backend.transfer.producer import EmbeddingPool
from clients.videos import make_h264_video

model = sys.argv[1]
clips = {size: [make_h264_video(*size, frames=30, fps=30, seed=seed, noise=False) for seed in range(3)]
         for size in ((448, 448), (1280, 720), (640, 360))}
# the encoder model's initialize: tower, VRAM pool, NVDEC decoders made and warmed up, the tower's and the service's warm-ups
encoder = load_encoder(model, device="cuda:0", dtype=torch.float32)
pool = EmbeddingPool(256 << 20, lease_seconds=30, device="cuda:0")
limits = MediaLimits(max_item_bytes=256 << 20, **checkpoint_media(model), nvdec_device=0)
nvdec.decoder(0)
encoder.warm_up()
service = EncoderService(encoder, pool, limits, cache_bytes=0)
service.warm_up()  # as the encoder model's initialize: a small video decoded (NVDEC) and encoded
for size, datas in clips.items():
    seconds = []
    for index, data in enumerate(datas):
        profile = cProfile.Profile() if index == 0 else None
        started = time.perf_counter()
        if profile:
            profile.enable()
        (layouts,) = service.run([EncodeJob(0, data, f"{size}-{index}", modality="video")], 1)
        torch.cuda.synchronize()
        if profile:
            profile.disable()
        assert not isinstance(layouts, BaseException), layouts
        seconds.append(time.perf_counter() - started)
        if profile:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(18)
            print(f"--- the first {size[0]}x{size[1]} video, profiled:", out.getvalue()[-3500:])
    print(f"SECONDS {size[0]}x{size[1]} " + " ".join(f"{s:.3f}" for s in seconds), flush=True)
pool.close()
'''


def test_a_fresh_encoder_s_first_video_costs_what_a_later_one_does():
    """The encoder instance's start (tower, VRAM pool, NVDEC decoders warmed up, the tower's and the service's
    warm-ups), in a fresh process as in the served encoder; then three videos of each of three sizes, the first of
    each profiled: the first video of a size may not cost much more than a later one (before the service's warm-up:
    8.7 s against 0.04 s on the H200, vLLM's video modules imported by the first decode)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    model = Path(os.environ.get("EPD_GPU_SERVE_MODEL") or root / "models" / "tiny-qwen2-vl")
    done = subprocess.run([sys.executable, "-c", FIRST_VIDEO, str(model)], capture_output=True, text=True,
                          timeout=300, cwd=root)
    print(done.stdout[-12000:], done.stderr[-3000:])
    assert done.returncode == 0
    for line in done.stdout.splitlines():
        if line.startswith("SECONDS"):
            _, size, first, *later = line.split()
            assert float(first) <= 2 * max(map(float, later)) + 0.25, line

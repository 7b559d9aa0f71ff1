"""``EncoderService.warm_up`` (called by the encoder model at load): a small item of each modality the encoder takes,
decoded as a request's item is, so that no request pays the decode path's first use (the first video's decode
imported vLLM's video loader: 2.9 s against 0.05 s for the next one on 2 cores, 8.7 s on the H200's encoder).

Each case runs in a fresh process (what a module imports on first use is only seen there): after the warm-up, the
first request of each modality imports no module, and the warm-up counted no decode; without it, the first video
imports vLLM's modules (the check can fail)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import io, json, sys, wave
from backend.encode.encoder import load_encoder
from backend.encode.service import EncodeJob, EncoderService
from backend.request.generate import checkpoint_media
from backend.request.media import MediaLimits, decode_counter
from backend.request.video import VIDEO_DECODES
from backend.transfer.producer import EmbeddingPool

model, warm, modalities = sys.argv[1], sys.argv[2] == "1", sys.argv[3].split(",")
encoder = load_encoder(model)
pool = EmbeddingPool(64 << 20, lease_seconds=30)
service = EncoderService(encoder, pool, MediaLimits(**checkpoint_media(model)))
if warm:
    service.warm_up()
report = {"warm_up_decodes": decode_counter.count, "warm_up_video_decodes": dict(VIDEO_DECODES), "imported": {}}

def item(name, seed):
    if name == "image":
        from PIL import Image
        out = io.BytesIO()
        Image.new("RGB", (56 + 28 * seed, 84), (seed * 40, 90, 200)).save(out, "PNG")
        return out.getvalue()
    if name == "audio":
        out = io.BytesIO()
        with wave.open(out, "wb") as file:
            file.setnchannels(1); file.setsampwidth(2); file.setframerate(8000)
            file.writeframes(bytes(range(256)) * 64)
        return out.getvalue()
    from clients.videos import make_h264_video
    return make_h264_video(112, 112, frames=8, fps=4, seed=seed, noise=False)

for name in modalities:
    data = item(name, 1)  # made before the snapshot: what making it imports is the test's, not the encoder's
    before = set(sys.modules)
    (layouts,) = service.run([EncodeJob(0, data, f"{name}-1", modality=name)], 1)
    assert not isinstance(layouts, BaseException), layouts
    report["imported"][name] = sorted(set(sys.modules) - before)
report["decodes"] = decode_counter.count
pool.close()
print("REPORT " + json.dumps(report))
'''


def _first_requests(model: str, warm: bool, modalities: str) -> dict:
    model_dir = ROOT / "models" / model
    if not model_dir.exists():
        pytest.skip(f"needs models/{model} (make setup)")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), "1" if warm else "0", modalities],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


@pytest.mark.parametrize("model, modalities", [("tiny-qwen2-vl", "video,image"), ("tiny-qwen2-audio", "audio")])
def test_after_the_warm_up_a_first_request_imports_nothing_and_the_warm_up_counts_no_decode(model, modalities):
    report = _first_requests(model, True, modalities)
    assert report["imported"] == {name: [] for name in modalities.split(",")}
    assert report["warm_up_decodes"] == 0 and report["warm_up_video_decodes"] == {}
    assert report["decodes"] == len(modalities.split(","))  # the requests' decodes are counted


def test_without_the_warm_up_the_first_video_imports_vllm_modules():
    """The control: the same first request in a process that skipped the warm-up imports vLLM's video modules (the
    first audio does likewise: 2.1 s on 2 cores, measured; not run here, one control is enough to show the check
    can fail)."""
    video = _first_requests("tiny-qwen2-vl", False, "video")
    assert any(name.startswith("vllm.multimodal") for name in video["imported"]["video"]), video["imported"]


def test_a_modality_that_cannot_be_warmed_is_logged_and_the_others_are_warmed(monkeypatch, caplog):
    """A sample that cannot be made (no PyAV for the clip, say) must not fail the encoder's load: it is logged, and
    the other modalities are still decoded and encoded."""
    from dataclasses import replace

    import backend.encode.service as service_module
    from backend.encode.encoder import load_encoder
    from backend.encode.service import EncoderService
    from backend.protocol.modality import IMAGE, VIDEO
    from backend.request.media import MediaLimits, handler

    model_dir = ROOT / "models" / "tiny-qwen2-vl"
    if not model_dir.exists():
        pytest.skip("needs models/tiny-qwen2-vl (make setup)")
    encoder = load_encoder(model_dir)
    real = service_module.handler

    def no_clip():
        raise ImportError("No module named 'av'")

    monkeypatch.setattr(service_module, "handler",
                        lambda m: replace(real(m), sample=no_clip) if m is VIDEO else real(m))
    encoded = []
    monkeypatch.setattr(encoder, "encode", lambda items: encoded.extend(items))
    with caplog.at_level("WARNING", logger="backend.encode.service"):
        EncoderService(encoder, pool=None, limits=MediaLimits()).warm_up()
    assert "no video decoded at load (ImportError" in caplog.text
    assert [type(item) for item in encoded] == [handler(IMAGE).decoded]

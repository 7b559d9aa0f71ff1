"""E2E: a video split across two encoder instances (``video_split: 2``) in a real tritonserver: ``epd`` (E+PD) and
``epd_disagg`` (E/P/D) give the ``llm`` baseline's tokens, and the unsplit path's (metadata-only off encodes each video whole), for videos of many
temporal patches, of one (one part is empty), and two at once; the parts come from two encoder instances."""
from __future__ import annotations

import pytest

from backend.deploy.local_server import ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.topology import load
from backend.protocol.generate import GenerateInputs
from clients.bench.video_split import split_topology
from clients.triton_client import generate
from tests.e2e.conftest import _shm_of_this_process, held_shm, left_behind
from tests.e2e.test_video import GREEDY, V, user
from tests.videos import make_video

pytestmark = pytest.mark.e2e

CLIPS = {
    "five_patches": [make_video(160, 120, frames=75, fps=15, seed=301)],   # 10 frames sampled: t = 5
    "one_patch": [make_video(64, 64, frames=2, fps=2, seed=302)],           # 2 frames: t = 1, part 0 of 2 empty
    "two_videos": [make_video(96, 160, frames=60, fps=12, seed=303), make_video(112, 112, frames=45, fps=15, seed=304)],
}


@pytest.fixture(scope="module")
def split_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("video-split") / "repo"
    render(split_topology(load(ROOT / "topologies" / "default.yaml", "cpu"), ("baseline", "E+PD", "E/P/D"), encoders=2,
                          split=2),
           repo)
    with TritonServer(repo, log_path=repo.parent / "server.log") as server:
        yield server
        held = held_shm(server.proc.pid) - _shm_of_this_process()
    assert not server.stragglers, f"processes outlived tritonserver: {server.stragglers}"
    assert not (leaked := left_behind(held)), f"/dev/shm entries leaked by the server: {sorted(leaked)}"


def ask(server, model: str, videos, **kw):
    messages = user(*[V] * len(videos), text="What happens?")
    return generate(server.grpc_url, model, GenerateInputs(messages=messages, videos=videos, sampling=GREEDY, **kw),
                    timeout=180)


@pytest.fixture(scope="module")
def baseline(split_server):
    return {name: ask(split_server, "llm", videos) for name, videos in CLIPS.items()}


@pytest.mark.parametrize("model", ["epd", "epd_disagg"])
@pytest.mark.parametrize("name", list(CLIPS))
def test_split_epd_gives_the_baseline_and_the_unsplit_tokens(split_server, baseline, name, model):
    want = baseline[name]
    split = ask(split_server, model, CLIPS[name])
    whole = ask(split_server, model, CLIPS[name], parameters={"epd_metadata_only": False})
    for got in (split, whole):
        assert (got.text, got.num_input_tokens, got.num_output_tokens) == (want.text, want.num_input_tokens,
                                                                           want.num_output_tokens)
    parts = {"five_patches": 2, "one_patch": 1, "two_videos": 4}[name]
    assert split.timings["items"] == len(CLIPS[name]) and split.timings.get("parts", 1) == parts
    assert "parts" not in whole.timings


def test_the_parts_come_from_both_encoder_instances(split_server):
    """Triton's dynamic batcher may put both parts in one batch of one instance; rendered without a queue delay and
    with the parts' requests 2 ms apart, an idle instance takes each (docs/operations.md, ``video_split``): of fresh
    videos, most requests must have had their parts on two instances (a busy machine may delay one)."""
    seen = [ask(split_server, "epd", [make_video(160, 120, frames=75, fps=15, seed=310 + i)]).timings["encoders"]
            for i in range(4)]
    print("encoders per request:", seen)
    assert sum(len(encoders) == 2 for encoders in seen) >= 3, seen

"""Workload files for the planner (clients.plan.workload): what they draw, and a clear error naming the field of a
bad one."""
import pytest

from clients.plan.workload import WorkloadError, load, parse

GOOD = {"arrivals": {"process": "poisson", "rate": 5.0}, "requests": 50, "seed": 1,
        "mix": [{"share": 3, "prompt_tokens": 8, "output_tokens": 4, "images": {"count": 2, "sizes": [[64, 48]]}},
                {"share": 1, "videos": {"count": 1, "size": [32, 32], "frames": 4}, "audios": {"count": 1, "seconds": 2}}]}


def test_a_workload_draws_its_mix_by_share_seeded():
    requests = parse(GOOD).draw()
    assert len(requests) == 50 and requests == parse(GOOD).draw()
    assert all(b.at >= a.at for a, b in zip(requests, requests[1:]))
    images = [r for r in requests if r.items and r.items[0].modality == "image"]
    assert 25 <= len(images) <= 45 and all(len(r.items) == 2 and r.items[0].kpixels == 64 * 48 / 1000 for r in images)
    others = [r for r in requests if r not in images]
    assert all([i.modality for i in r.items] == ["video", "audio"] and r.output_tokens == 64 for r in others)


def test_a_trace_file_sets_the_arrivals_and_classes(tmp_path):
    (tmp_path / "t.csv").write_text("t,class\n0.5,1\n0.1,0\n0.2,\n")
    doc = {**GOOD, "arrivals": {"process": "trace", "file": "t.csv"}}
    (tmp_path / "w.yaml").write_text(__import__("yaml").safe_dump(doc))
    requests = load(tmp_path / "w.yaml").draw()
    assert [r.at for r in requests] == [0.1, 0.2, 0.5]
    assert requests[0].items[0].modality == "image" and requests[2].items[0].modality == "video"


@pytest.mark.parametrize("change, field", [
    ({"arrivals": {"process": "burst"}}, "arrivals.process"),
    ({"arrivals": {"process": "poisson", "rate": -1}}, "arrivals.rate"),
    ({"arrivals": {"process": "closed", "concurrency": 2.5}}, "arrivals.concurrency"),
    ({"arrivals": {"process": "poisson", "rate": 1, "concurrency": 2}}, "arrivals.concurrency: unknown field"),
    ({"mix": []}, "mix: expected a list"),
    ({"mix": [{"images": {"count": "two", "sizes": [[1, 1]]}}]}, "mix[0].images.count"),
    ({"mix": [{"images": {"count": 1, "sizes": [[64]]}}]}, "mix[0].images.sizes[0]"),
    ({"mix": [{"output_tokens": 0}]}, "mix[0].output_tokens"),
    ({"mix": [{"videos": {"count": 1, "size": [8, 8], "frames": 0}}]}, "mix[0].videos.frames"),
    ({"mix": [{"audio": {}}]}, "mix[0].audio: unknown field"),
    ({"slo": {"ttft_ms": 5}}, "slo.ttft_ms: unknown field"),
    ({"high_priority_share": 2}, "high_priority_share"),
])
def test_a_bad_workload_is_refused_naming_the_field(change, field):
    with pytest.raises(WorkloadError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse({**GOOD, **change})


def test_a_bad_file_names_itself_and_the_field(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("arrivals: {process: poisson, rate: 1}\nmix: [{prompt_tokens: -3}]\n")
    with pytest.raises(WorkloadError, match=r"w\.yaml: mix\[0\]\.prompt_tokens: expected an integer >= 0, got -3"):
        load(path)
    (tmp_path / "t.csv").write_text("t,class\n0.1,9\n")
    path.write_text("arrivals: {process: trace, file: t.csv}\nmix: [{}]\n")
    with pytest.raises(WorkloadError, match=r"arrivals\.file: t\.csv row 1: class"):
        load(path)

"""The differential runner's comparison (``tests.differential.runner``) against a fake server: the same answers pass;
another answer, a refusal naming another field, or an internal error fails with the seed, the case and its replay
command; a refusal the baseline gives is wanted alike on every route (an inlined item named where it is)."""
from __future__ import annotations

import pytest

from tests.differential.cases import Case, Item, generate_all
from tests.differential.clients import Outcome
from tests.differential.families import FAMILIES
from tests.differential.runner import MODELS, run

FAM = FAMILIES["qwen2_vl"]


class FakeTarget:
    """Answers a valid request with one text and token ids (``answers`` overrides per (model, route)), an invalid one
    with INVALID_ARG naming the field it expects (``fields`` overrides)."""

    models = MODELS

    def __init__(self, answers=None, fields=None):
        self.answers, self.fields, self.asked = answers or {}, fields or {}, []

    def ask(self, model, built):
        self.asked.append((model, built.route))
        if (model, built.route) in self.answers:
            return self.answers[(model, built.route)](built)
        if built.expect is not None:
            return Outcome("INVALID_ARG", field=self.fields.get((model, built.route), built.expect))
        ids = (1, 2) if built.route == "grpc" else None
        return Outcome("OK", "ab", 10, 2, "length", token_ids=ids)


@pytest.fixture(scope="module")
def cases():
    found = generate_all(FAM, 7, 30)
    assert any(c.invalid for c in found) and any(not c.invalid for c in found)
    return found


def test_the_same_answers_pass_and_every_route_is_asked(cases):
    target = FakeTarget()
    summary = run(cases, target, concurrency=4, window=10)
    assert not summary.failures and summary.cases == 30 and summary.invalid == sum(bool(c.invalid) for c in cases)
    assert {pair for pair in target.asked} == {(m, r) for m in ("llm", "epd", "epd_disagg") for r in ("grpc", "openai")}


def test_another_answer_fails_with_the_replay_command(cases):
    other = lambda built: Outcome("OK", "ab", 10, 2, "length", token_ids=(1, 3))  # same text, another token
    summary = run(cases, FakeTarget({("epd", "grpc"): other}), concurrency=4, window=10, recheck_failures=False)
    assert [(f.case.index, f.model, f.route) for f in summary.failures] == [(c.index, "epd", "grpc") for c in cases]
    valid = [c for c in cases if not c.invalid]  # the invalid ones fail too: answered, not refused
    report = next(f for f in summary.failures if f.case is valid[0]).report()
    assert f"replay: python -m tests.differential --family qwen2_vl --seed 7 --only {valid[0].index}" in report
    assert "ids [1, 3]" in report and not summary.errors


def test_a_refusal_naming_another_field_fails(cases):
    summary = run(cases, FakeTarget(fields={("epd_disagg", "openai"): "messages"}), concurrency=4, window=10,
                  recheck_failures=False)
    failing = {f.case.index for f in summary.failures}
    assert failing and failing <= {c.index for c in cases if c.invalid}
    assert all(f.model == "epd_disagg" and f.route == "openai" for f in summary.failures)


def test_an_internal_error_fails_even_when_the_baseline_has_it_too(cases):
    internal = lambda built: Outcome("INTERNAL", message="internal error: ZeroDivisionError")
    target = FakeTarget({(m, r): internal for m in ("llm", "epd") for r in ("grpc", "openai")})
    summary = run(cases[:5], target, concurrency=2, window=5)
    assert len(summary.errors) == 5 * 4  # llm and epd on both routes, each case
    assert all("wrong alone too" in f.alone for f in summary.errors)
    answered = [f for f in summary.failures if f not in summary.errors]  # epd_disagg, where the baseline failed
    assert {f.model for f in answered} == {"epd_disagg"} and len(answered) == 2 * sum(not c.invalid for c in cases[:5])


def test_a_baseline_refusal_is_wanted_on_every_route_at_the_item_s_place():
    video = Item("video", {"w": 32, "h": 32, "frames": 1, "fps": 2, "codec": "mp4v", "seed": 0})
    case = Case("qwen2_vl", 7, 0, "chat", items=[video], turns=[{"role": "user", "parts": [{"item": 0}]}],
                sampling={"temperature": 0.0, "max_tokens": 2})
    refused = lambda field: (lambda built: Outcome("INVALID_ARG", field=field))
    answers = {(m, "grpc"): refused("video[0]") for m in ("llm", "epd", "epd_disagg")}
    right = {**answers, **{(m, "openai"): refused("messages[0].content[0].video_url") for m in ("llm", "epd")}}
    summary = run([case], FakeTarget({**right, ("epd_disagg", "openai"): refused("video[0]")}), recheck_failures=False)
    assert summary.refused == 1 and [(f.model, f.route) for f in summary.failures] == [("epd_disagg", "openai")]

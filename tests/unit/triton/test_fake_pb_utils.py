"""The fake pb_utils keeps the real stub's rules the adapter tests lean on (python_backend ``response_sender.cc``,
``metric.cc``): a fake laxer than Triton would let an adapter bug pass."""
import numpy as np
import pytest

FINAL = 1


def test_a_sender_takes_nothing_after_the_final_flag(pb):
    sender = pb.InferenceRequest("m", [], []).get_response_sender()
    sender.send(pb.InferenceResponse([]), flags=0)
    sender.send(flags=FINAL)
    with pytest.raises(pb.TritonModelException, match="has been closed"):
        sender.send(flags=FINAL)


@pytest.mark.parametrize("response, flags", [(None, 0), ("response", 2)])
def test_a_send_without_a_response_needs_the_final_flag_and_flags_are_0_or_final(pb, response, flags):
    sender = pb.InferenceRequest("m", [], []).get_response_sender()
    with pytest.raises(pb.TritonModelException):
        sender.send(pb.InferenceResponse([]) if response else None, flags=flags)
    assert sender.sent == []


def test_request_parameters_are_json_of_strings_ints_and_bools(pb):
    assert pb.InferenceRequest("m", [], [], parameters={"a": "x", "b": 1, "c": True}).parameters() == \
        '{"a": "x", "b": 1, "c": true}'
    with pytest.raises(pb.TritonModelException):
        pb.InferenceRequest("m", [], [], parameters={"a": 0.5})


def test_tensors_hold_numpy_arrays(pb):
    with pytest.raises(TypeError):
        pb.Tensor("x", [1, 2])
    request = pb.InferenceRequest("m", [pb.Tensor("x", np.array([1]))], [])
    assert pb.get_input_tensor_by_name(request, "x").as_numpy().tolist() == [1]
    assert pb.get_input_tensor_by_name(request, "y") is None


def test_metrics_keep_their_kind(pb):
    counter = pb.MetricFamily("c", "a counter", pb.MetricFamily.COUNTER).Metric(labels={"model": "m"})
    with pytest.raises(pb.TritonModelException):
        counter.increment(-1)
    with pytest.raises(pb.TritonModelException):
        counter.set(3)
    with pytest.raises(pb.TritonModelException):
        pb.MetricFamily("c", "a gauge now", pb.MetricFamily.GAUGE)
    with pytest.raises(pb.TritonModelException):
        pb.MetricFamily("h", "a histogram", pb.MetricFamily.HISTOGRAM).Metric(labels={})  # no buckets
    same = pb.MetricFamily("c", "a counter", pb.MetricFamily.COUNTER).Metric(labels={"model": "m"})
    counter.increment(2)
    assert same.value() == 2  # equal labels: one series


def test_bls_to_a_model_not_served_answers_an_error(pb):
    response = pb.InferenceRequest("nowhere", [], []).exec()
    assert response.has_error() and pb.code_name(response.error().code()) == "NOT_FOUND"

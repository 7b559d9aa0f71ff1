"""Unit tests of the Triton adapters (``backend/triton/``) against the fake pb_utils (``tests.fake_pb_utils``):
installed here, before the test modules import an adapter; reset before each test."""
import pytest

from tests import fake_pb_utils

fake_pb_utils.install()


@pytest.fixture(autouse=True)
def pb(thawed_heap):
    """The fake pb_utils, with no BLS handler, metric or log line left from another test (and the heap a model's
    load froze thawed: tests/conftest.py)."""
    fake_pb_utils.reset()
    yield fake_pb_utils
    fake_pb_utils.reset()

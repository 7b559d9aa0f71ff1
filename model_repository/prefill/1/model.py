"""Triton Python-backend entry point of `prefill`: the model class lives in backend.triton.models.prefill."""
from backend.triton.models.prefill import TritonPythonModel  # noqa: F401

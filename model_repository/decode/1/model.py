"""Triton Python-backend entry point of `decode`: the model class lives in backend.triton.models.decode."""
from backend.triton.models.decode import TritonPythonModel  # noqa: F401

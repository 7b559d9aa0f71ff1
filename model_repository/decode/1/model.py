"""Triton Python-backend entry point of `decode`: the model class lives in backend.models.decode."""
from backend.models.decode import TritonPythonModel  # noqa: F401

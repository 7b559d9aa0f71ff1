"""Triton Python-backend entry point of `epd_disagg`: the model class lives in backend.triton.models.epd."""
from backend.triton.models.epd import TritonPythonModel  # noqa: F401

"""Triton Python-backend entry point of `epd_disagg`: the model class lives in ensemble.epd_model."""
from ensemble.epd_model import TritonPythonModel  # noqa: F401

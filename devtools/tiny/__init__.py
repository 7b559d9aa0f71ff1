"""Tiny random-weight checkpoints, built locally and deterministically (``python -m devtools.tiny``; scripts/setup.sh)."""

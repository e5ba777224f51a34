"""The old import path of the model app builder (`rayrunner.replica.model_server:build_model_app` now)."""

from rayrunner.replica.model_server import build_model_app

__all__ = ["build_model_app"]

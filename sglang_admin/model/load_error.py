"""The one error a model load raises (model/loader.py, model/quant/)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message says why in one line."""

"""kvserve operator: reconciles ``InferenceModel`` resources into engine Deployments."""

__version__ = "0.1.0"

"""Tracking: MLflow, TensorBoard and W&B side by side (tracker.py and one module each), a console
progress line (tracker.py); metrics.jsonl (metrics_file.py)."""

from rlhf.track.metrics_file import MetricsFile
from rlhf.track.tracker import Console, Tracker, default_tracking_uri

__all__ = ["Console", "MetricsFile", "Tracker", "default_tracking_uri"]

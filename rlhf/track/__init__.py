"""Tracking: MLflow (default) and a console progress line. See tracker.py."""

from rlhf.track.tracker import Console, Tracker, default_tracking_uri, output_root

__all__ = ["Console", "Tracker", "default_tracking_uri", "output_root"]

from rlhf.ckpt.manager import CheckpointInfo, CheckpointManager, find_latest

__all__ = ["CheckpointInfo", "CheckpointManager", "find_latest"]

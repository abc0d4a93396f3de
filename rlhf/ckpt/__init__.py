from rlhf.ckpt.manager import CheckpointInfo, CheckpointManager, ResumePoint, find_latest, resume_point, verify

__all__ = ["CheckpointInfo", "CheckpointManager", "ResumePoint", "find_latest", "resume_point", "verify"]

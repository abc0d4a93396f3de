"""rlhf: RLHF training (PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++, DPO, RM, SFT) from composable configs."""

__version__ = "0.1.0"

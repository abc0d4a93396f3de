"""Training loops, one readable file per kind: rl (PPO, GRPO, ...); sft, rm, dpo come later."""

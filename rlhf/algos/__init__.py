"""Pure-torch RL algorithm core: advantages, KL, reward shaping, losses,
preference losses and sample filters. No distributed/engine dependencies."""

from rlhf.algos.advantages import (
    ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    masked_mean,
    masked_sum_rows,
    masked_var,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlhf.algos.filters import dynamic_sampling_filter
from rlhf.algos.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from rlhf.algos.logprobs import logprobs_from_hidden
from rlhf.algos.losses import (
    AGG_MODES,
    aggregate,
    aggregation_denominator,
    entropy_from_logits,
    micro_batch_loss,
    policy_loss,
    token_logprobs,
    value_loss,
)
from rlhf.algos.preference import DPO_LOSS_TYPES, bradley_terry_loss, dpo_loss, sft_loss
from rlhf.algos.shaping import last_policy_token_index, normalize_scores, overlong_penalty, token_level_rewards

__all__ = [
    "ESTIMATORS",
    "broadcast_to_tokens",
    "compute_advantages",
    "discounted_returns",
    "dr_grpo_advantages",
    "gae",
    "grpo_advantages",
    "masked_mean",
    "masked_sum_rows",
    "masked_var",
    "masked_whiten",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "dynamic_sampling_filter",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "kl_penalty",
    "logprobs_from_hidden",
    "AGG_MODES",
    "aggregate",
    "aggregation_denominator",
    "entropy_from_logits",
    "micro_batch_loss",
    "policy_loss",
    "token_logprobs",
    "value_loss",
    "DPO_LOSS_TYPES",
    "bradley_terry_loss",
    "dpo_loss",
    "sft_loss",
    "last_policy_token_index",
    "normalize_scores",
    "overlong_penalty",
    "token_level_rewards",
]

"""Pure-torch RL algorithm core: advantages, KL, reward shaping, losses, the RL objective,
preference losses, the offline algorithms' objectives (``offline``) and sample filters. No distributed/engine dependencies.

Importing the package imports no torch: ``rlhf.algos.registry`` (the names of the algorithm parts
and their metadata) is read by the torch-free spec. The names below load their module on first
use (``from rlhf.algos import compute_advantages``).
"""

import importlib

_EXPORTS = {
    "advantages": (
        "AdvantageInputs",
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
    ),
    "distill": ("distill_metrics", "distill_token_rewards", "divergence_weight"),
    "filters": ("dynamic_sampling_filter",),
    "kl": ("AdaptiveKLController", "FixedKLController", "kl_penalty", "logprob_mismatch", "mismatch_sums"),
    "logprobs": ("logprobs_from_hidden",),
    "losses": (
        "PolicyLossInputs",
        "aggregate",
        "aggregation_denominator",
        "entropy_from_logits",
        "micro_batch_loss",
        "policy_loss",
        "token_logprobs",
        "value_loss",
    ),
    "preference": ("DPO_LOSS_TYPES", "PREFERENCE_METHODS", "REFERENCE_FREE_METHODS", "bradley_terry_loss", "dpo_loss",
                   "kto_loss", "kto_reference_point", "log_odds", "orpo_loss", "pair_preference_loss", "simpo_loss", "sft_loss"),
    "shaping": ("last_policy_token_index", "normalize_scores", "overlong_penalty", "token_level_rewards"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_HOME)


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value

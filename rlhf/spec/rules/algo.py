"""The algo section: an RL run's registered parts and their settings, DPO's loss, and the keys
every algorithm kind shares."""

from __future__ import annotations

from typing import Any, Optional

from rlhf.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    DISTILL_DIVERGENCES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    EstimatorInfo,
    Registry,
    plugin_problem,
)
from rlhf.placement import registry as placements
from rlhf.rollout import registry as engines
from rlhf.spec.rules import Sections
from rlhf.spec.rules.checks import choice
from rlhf.spec.schema import RLAlgo

KL_PLACEMENTS = ("loss", "reward")


def estimator_info(algo: RLAlgo) -> Optional[EstimatorInfo]:
    """The metadata of ``algo.estimator`` (after importing ``algo.plugins``), None if it is not
    registered or a plugin does not import (validation says so)."""
    for module in algo.plugins:
        plugin_problem(module)
    return ADVANTAGE_ESTIMATORS.info(algo.estimator) if algo.estimator in ADVANTAGE_ESTIMATORS.names() else None


def _part(problems: list[str], registry: Registry, name: str) -> None:
    if name not in registry.names():
        problems.append(registry.unknown(name))


def _rollout_beside_training(s: Sections, roles: tuple[str, ...]) -> bool:
    """The placement puts the rollout engines on a trained role's devices (False for an unknown
    placement: its own message says so)."""
    pl = s["placement"]
    try:
        pools = placements.get(pl.mode, pl.plugins).pools(roles)
    except Exception:  # noqa: BLE001 - an unknown placement or a plugin that does not import
        return False
    return any("rollout" in pool and ("actor" in pool or "critic" in pool) for pool in pools)


def _engine_sleeps(s: Sections) -> bool:
    """The run's rollout engine frees its memory while training runs (``EngineKind.sleeps``; False
    for an unknown engine: its own message says so)."""
    ro = s["rollout"]
    try:
        return engines.get(engines.resolve(ro.engine, s["hardware"].accelerator, ro.plugins), ro.plugins).sleeps
    except Exception:  # noqa: BLE001 - an unknown engine or a plugin that does not import
        return False


def problems(s: Sections, roles: tuple[str, ...]) -> list[str]:
    """The algo section's problems: its kind's rules, then the keys all kinds share."""
    algo = s["algo"]
    p = rl_problems(s, roles) if algo.kind == "rl" else dpo_problems(s) if algo.kind == "dpo" else []
    for key in ("lr", "epochs"):
        if getattr(algo, key) <= 0:
            p.append(f"algo.{key}={getattr(algo, key)} must be > 0.")
    if hasattr(algo, "eval_fraction") and not 0 <= algo.eval_fraction < 1:
        p.append(f"algo.eval_fraction={algo.eval_fraction} must be in [0, 1).")
    return p


def rl_problems(s: Sections, roles: tuple[str, ...]) -> list[str]:
    """An RL algo: the registered parts (after importing ``algo.plugins``), what the estimator needs
    (a group, a critic), clipping, the asynchronous mode, the KL penalty and reward shaping."""
    algo, rollout = s["algo"], s["rollout"]
    # the plugins first: their decorators register the names checked next
    p = [msg for msg in map(plugin_problem, algo.plugins) if msg is not None]
    _part(p, ADVANTAGE_ESTIMATORS, algo.estimator)
    _part(p, POLICY_LOSSES, algo.policy_loss)
    choice(p, "algo.loss_agg", algo.loss_agg, LOSS_AGGREGATIONS)
    choice(p, "algo.ratio_level", algo.ratio_level, ("token", "sequence"))
    _part(p, KL_ESTIMATORS, algo.kl.estimator)
    choice(p, "algo.kl.placement", algo.kl.placement, KL_PLACEMENTS)
    est = estimator_info(algo)
    if algo.group_size < 1:
        p.append(f"algo.group_size={algo.group_size} must be at least 1.")
    elif est is not None and est.grouped and algo.group_size < 2:
        p.append(
            f"algo.group_size={algo.group_size}: {algo.estimator} compares samples of the same prompt, "
            "so it needs at least 2. Use algo.group_size=4 or more."
        )
    if est is not None and est.needs_critic and algo.critic is None:
        p.append(f"algo.estimator={algo.estimator} needs a critic: set algo.critic.lr (and value_clip), "
                 "or use algo=ppo.")
    if est is not None and not est.needs_critic and algo.critic is not None:
        p.append(
            f"algo.critic is set but algo.estimator={algo.estimator} uses no critic (gae does). "
            "Remove the critic settings (algo.critic=null) or use algo=ppo."
        )
    if not algo.whiten_advantages and est is not None and not est.whiten:
        p.append(f"algo.whiten_advantages=false only applies to estimators that whiten (gae, PPO's); "
                 f"{algo.estimator} sets its own advantage scale. Drop the override.")
    if algo.clip_low <= 0 or algo.clip_high <= 0:
        p.append(f"algo.clip_low={algo.clip_low}, algo.clip_high={algo.clip_high}: clip ranges must be > 0.")
    if algo.dual_clip is not None and algo.dual_clip <= 1:
        p.append(f"algo.dual_clip={algo.dual_clip} must be > 1 (3.0 is usual), or null to turn it off.")
    p.extend(_policy_loss_problems(algo))
    p.extend(_teacher_problems(s))
    p.extend(_async_problems(s, roles))
    if algo.tis_cap is not None and algo.tis_cap <= 0:
        p.append(f"algo.tis_cap={algo.tis_cap} must be > 0 (2.0 is usual), or null to turn it off.")
    if algo.kl.coef < 0:
        p.append(f"algo.kl.coef={algo.kl.coef} must be >= 0.")
    if algo.kl.adaptive and algo.kl.placement != "reward":
        p.append("algo.kl.adaptive=true adapts a KL penalty in the reward: set algo.kl.placement=reward.")
    if not 0 <= algo.lam <= 1 or not 0 <= algo.gamma <= 1:
        p.append(f"algo.gamma={algo.gamma}, algo.lam={algo.lam}: both must lie in [0, 1].")
    if algo.overlong_buffer is not None and not 0 < algo.overlong_buffer <= rollout.max_response_tokens:
        p.append(
            f"algo.overlong_buffer={algo.overlong_buffer} must be in (0, rollout.max_response_tokens="
            f"{rollout.max_response_tokens}]."
        )
    return p


def _teacher_problems(s: Sections) -> list[str]:
    """On-policy distillation: the distill estimator and a teacher go together; the divergence and
    its settings; a teacher whose vocabulary (its config.json's, or algo.teacher.vocab) is not the
    student's cannot score the student's token ids."""
    algo, p = s["algo"], []
    t = algo.teacher
    if algo.estimator == "distill" and not t.path:
        p.append("algo.estimator=distill needs a teacher: set algo.teacher.path=<checkpoint dir or Hub id> "
                 "(a causal LM with the student's tokenizer).")
    if t.path and algo.estimator != "distill":
        p.append(f"algo.teacher.path is set but algo.estimator={algo.estimator} does not use it: on-policy "
                 "distillation needs algo.estimator=distill (algo=opd), or drop algo.teacher.path.")
    if not t.path:
        return p
    choice(p, "algo.teacher.divergence", t.divergence, DISTILL_DIVERGENCES)
    if t.divergence == "jsd" and not 0 < t.beta < 1:
        p.append(f"algo.teacher.beta={t.beta} must lie strictly between 0 and 1 for divergence=jsd "
                 "(0.5 is GKD's usual; for reverse KL use algo.teacher.divergence=reverse_kl).")
    if t.coef <= 0:
        p.append(f"algo.teacher.coef={t.coef} must be > 0 (1.0: the divergence itself).")
    if t.clamp is not None and t.clamp <= 0:
        p.append(f"algo.teacher.clamp={t.clamp} must be > 0, or null for no bound.")
    from rlhf.spec.shape import teacher_model

    m = s["model"]
    vocab = teacher_model(m, t).vocab
    if vocab != m.vocab:
        p.append(f"algo.teacher.path={t.path} has a vocabulary of {vocab} tokens, the student (model={m.name}) "
                 f"{m.vocab}: the teacher must score the student's token ids. Use a teacher with the student's "
                 "tokenizer.")
    return p


def _policy_loss_problems(algo: RLAlgo) -> list[str]:
    """The policy losses beyond the clipped surrogate (cispo, sapo) and DAPO's buffer as a fraction."""
    p: list[str] = []
    loss = algo.policy_loss
    if loss == "clip" and algo.clip_low >= 1:
        p.append(f"algo.clip_low={algo.clip_low} must be < 1 with policy_loss=clip (0.2 is usual).")
    if loss == "cispo" and algo.clip_low > 1:
        p.append(f"algo.clip_low={algo.clip_low} must be <= 1 with policy_loss=cispo (1 = no lower bound on the "
                 "importance weight, as MiniMax-M1).")
    if loss in ("cispo", "sapo"):
        if algo.ratio_level != "token":
            p.append(f"algo.ratio_level={algo.ratio_level} applies to policy_loss=clip (GSPO); {loss} weighs "
                     "each token by its own ratio. Set algo.ratio_level=token or algo.policy_loss=clip.")
        if algo.dual_clip is not None:
            p.append(f"algo.dual_clip bounds the clipped surrogate; policy_loss={loss} has none. Set "
                     "algo.dual_clip=null.")
    if algo.tau_pos <= 0 or algo.tau_neg <= 0:
        p.append(f"algo.tau_pos={algo.tau_pos}, algo.tau_neg={algo.tau_neg}: SAPO's temperatures must be > 0 "
                 "(1.0 and 1.05 are the paper's).")
    frac = algo.overlong_buffer_fraction
    if frac is not None:
        if not 0 < frac <= 1:
            p.append(f"algo.overlong_buffer_fraction={frac} must be in (0, 1] (DAPO's is 0.2), or null.")
        if algo.overlong_buffer is not None:
            p.append(f"algo.overlong_buffer={algo.overlong_buffer} and algo.overlong_buffer_fraction={frac} are "
                     "both set: set one of them (the other null).")
    return p


def _async_problems(s: Sections, roles: tuple[str, ...]) -> list[str]:
    """algo.async_steps: sampling with a stale policy needs the correction, engines of their own and
    a single-turn, fixed-size batch."""
    algo, p = s["algo"], []
    if algo.async_steps < 0:
        p.append(f"algo.async_steps={algo.async_steps} must be >= 0 (0 = synchronous).")
    if algo.async_steps > 0:
        if algo.tis_cap is None:
            p.append(f"algo.async_steps={algo.async_steps} samples with a stale policy: set algo.tis_cap "
                     "(2.0 is usual) for the importance-sampling correction.")
        if algo.dynamic_sampling:
            p.append("algo.async_steps > 0 with algo.dynamic_sampling=true is not supported: turn one off.")
        if s["hardware"].accelerator == "cuda" and _rollout_beside_training(s, roles) and _engine_sleeps(s):
            # the engines generate during the update on the trainers' GPUs: neither side may move out
            pl, k = s["placement"], algo.async_steps
            if pl.sleep_rollout is True:
                p.append(f"algo.async_steps={k} has the rollout engines generate during the update on the same GPUs, "
                         "but placement.sleep_rollout=true puts them to sleep then. Use placement.sleep_rollout=auto "
                         "(awake under async), or algo.async_steps=0.")
            if pl.offload_train_state is True:
                p.append(f"algo.async_steps={k} updates while the rollout engines generate on the same GPUs, but "
                         "placement.offload_train_state=true moves the training states out for them. Use "
                         "placement.offload_train_state=auto (resident under async), or algo.async_steps=0.")
        if s.get("env") is not None and s["env"].fn is not None:
            p.append("algo.async_steps > 0 with env.fn is not supported: set algo.async_steps=0.")
    return p


def dpo_problems(s: Sections) -> list[str]:
    """The preference trainer (DPO, KTO, ORPO, SimPO): its loss and coefficients."""
    algo, p = s["algo"], []
    choice(p, "algo.loss_type", algo.loss_type, PREFERENCE_LOSSES)
    _preference_problems(p, algo)
    if algo.beta <= 0:
        p.append(f"algo.beta={algo.beta} must be > 0 (0.1 is usual).")
    if not 0 <= algo.label_smoothing < 0.5:
        p.append(f"algo.label_smoothing={algo.label_smoothing} must be in [0, 0.5).")
    return p


def _preference_problems(p: list[str], algo: Any) -> None:
    method = algo.loss_type
    if method in REFERENCE_FREE_LOSSES and not algo.reference_free:
        p.append(f"algo.loss_type={method} has no reference term: set algo.reference_free=true (algo={method} does).")
    if method == "kto" and algo.reference_free:
        p.append("algo.loss_type=kto measures rewards against the reference model: set algo.reference_free=false.")
    if algo.label_smoothing > 0 and method != "sigmoid":
        p.append(f"algo.label_smoothing={algo.label_smoothing} applies to loss_type=sigmoid (cDPO) only: set it to 0.")
    if method == "simpo" and algo.gamma < 0:
        p.append(f"algo.gamma={algo.gamma} must be >= 0 (SimPO's target margin; 1.0 with beta 2.0 is usual).")
    if method == "kto" and (algo.desirable_weight <= 0 or algo.undesirable_weight <= 0):
        p.append(f"algo.desirable_weight={algo.desirable_weight}, algo.undesirable_weight={algo.undesirable_weight}: "
                 "both must be > 0 (1.0 each is KTO's default).")

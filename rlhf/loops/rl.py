"""The RL loop: PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline.

One step, top to bottom:

    prompts   → rollout engines sample group_size responses each (seeded per prompt)
              → reward functions (+ reward model) score them; dynamic sampling may resample
              → schedule.to_train() (hybrid GPU: vLLM sleeps, DeepSpeed's states come back)
              → reference log-probs (KL), old log-probs (off-policy steps / KL in reward),
                critic values (PPO)
              → advantages (rlhf.algos.objective: overlong penalty, KL in reward, estimator, whitening)
              → policy update (+ critic update), mini-batches × epochs, split over DP ranks
              → schedule.to_generate(): weight sync to the rollout engines (hybrid GPU: and
                the device back to vLLM; rlhf.workers.schedule) → metrics → checkpoint hook

Everything placement- or device-specific is behind ``cluster``; all math is in ``rlhf.algos``.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Optional

import torch

from rlhf import algos
from rlhf.algos.objective import Objective
from rlhf.ckpt import training as ckpt_io
from rlhf.data.batch import Batch, collate, concat, dp_forward, padded_rows, select, size
from rlhf.data.prompts import PromptSource, tokenize_prompts
from rlhf.launch.cluster import Cluster
from rlhf.launch.group import ActorGroup
from rlhf.quoting import resume_command
from rlhf.rewards import RewardError, Rewards, score_samples
from rlhf.rollout.engine import Sample
from rlhf.rollout.generate import generate, sampling_for
from rlhf.spec.runspec import RunSpec
from rlhf.track.tracker import Console, Tracker
from rlhf.workers.schedule import make_schedule
from rlhf.workers.critic import CriticWorker
from rlhf.workers.frozen import ReferenceWorker, TeacherWorker
from rlhf.workers.policy import PolicyWorker


class Phases:
    """Wall time per phase of a step: ``with phases("generate"): ...``. A CUDA out-of-memory
    error in a phase becomes one line naming the phase, the plan's figure and what to change;
    any other error is marked with the phase and step for the run's error line."""

    def __init__(self, spec: Optional[RunSpec] = None, step: Optional[int] = None):
        self.spec = spec
        self.step = step
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        except Exception as e:
            from rlhf.plan.oom import is_cuda_oom, oom_message

            if self.spec is not None and is_cuda_oom(e):
                from rlhf.spec.errors import UserError

                raise UserError(oom_message(self.spec, name)) from None
            if self.step is not None:
                from rlhf.launch.failures import mark

                mark(e, name, self.step + 1)
            raise
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t


@contextlib.contextmanager
def lean_driver(spec: RunSpec):
    """For the loop's duration: objects built during setup are frozen out of the garbage
    collector's scans (``gc.freeze``), and on GPU runs the driver's torch uses one thread. The
    driver only coordinates there; its tensor work (collate, advantages) is a few ``[B, T]`` ops
    that a full OpenMP pool, competing for the cores with the engine and trainer processes, slows
    down rather than speeds up. Both are the process's: a job of a threaded sweep
    (``hydra/launcher=parallel``) shares them with the other jobs and leaves them alone."""
    import gc
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    threads = torch.get_num_threads()
    gc.collect()
    gc.freeze()
    if spec.hardware.accelerator == "cuda":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()


def run(spec: RunSpec, cluster: Cluster, tracker: Tracker, console: Console, run_dir: str) -> dict[str, float]:
    from rlhf.models import load_tokenizer, model_dir

    algo, B = spec.algo, spec.batch
    tokenizer = load_tokenizer(model_dir(spec))
    data = PromptSource(spec.data, spec.train.seed)
    from rlhf.preflight import long_prompt_filter

    dropped = data.drop(long_prompt_filter(spec, tokenizer))  # counted in the driver's preflight too
    if dropped:
        console.print(f"data: dropped {dropped} prompts longer than rollout.max_prompt_tokens="
                      f"{spec.rollout.max_prompt_tokens}")
    rewards = Rewards(spec.reward)
    objective = Objective(algo)  # its registered parts looked up once, not every step
    kl_ctl = (algos.AdaptiveKLController(algo.kl.coef, algo.kl.target, algo.kl.horizon) if algo.kl.adaptive
              else algos.FixedKLController(algo.kl.coef))
    schedule = make_schedule(spec, cluster)  # generation first: vLLM awake, DeepSpeed's states offloaded
    # the reference policy: its own workers, or (LoRA) the actor with its adapters switched off
    reference = (cluster.reference, ReferenceWorker.logprobs) if cluster.reference is not None else (
        (cluster.actor, PolicyWorker.ref_logprobs) if algo.kl.coef > 0 and spec.model.lora.rank > 0 else None)
    use_ref = reference is not None
    kl_in_reward = use_ref and algo.kl.placement == "reward"
    # A separate pass for the policy's log-probs before the update is needed only when the
    # update is not exactly on-policy (several optimizer steps, async rollouts) or when they are
    # needed before it (KL in the reward, truncated importance sampling). Otherwise the ratio is
    # identically 1 and the update's own forward gives the same numbers (and the mismatch).
    need_old_logp = (B.optimizer_steps_per_step > 1 or algo.tis_cap is not None or kl_in_reward
                     or algo.async_steps > 0)
    prefetch = None
    if algo.async_steps > 0:  # rollouts of the next steps overlap the update (rlhf.loops.async_rl)
        from rlhf.loops.async_rl import Prefetcher

        prefetch = Prefetcher(spec, cluster, data, tokenizer)
    agent = None
    if spec.agent.enabled:  # chats with tool calls (rlhf.agent): each trajectory advances on its own
        from rlhf.agent.rollout import AgentRollout

        agent = AgentRollout(spec, tokenizer, cluster.rollout.workers)
    ckpt = ckpt_io.manager(spec, run_dir)
    from rlhf.loops.rl_eval import make_evaluator

    # eval.every > 0 and data.eval_files
    evaluator = make_evaluator(spec, cluster, tokenizer, rewards, console, agent=agent)
    history: list[dict[str, float]] = []
    start = 0
    resumed = ckpt_io.latest(spec, run_dir)
    if resumed is not None:  # resume=<run dir>, or a restarted run whose dir has a checkpoint
        state = ckpt_io.restore(resumed, cluster)
        data.load_state_dict(state["data"])
        kl_ctl.load_state_dict(state["kl"])
        history, start = state["history"], state["step"]
        schedule.to_train()
        schedule.to_generate()  # the rollout engines get the restored policy
        console.print(f"resumed from {resumed.path} at step {start + 1}")
    # the starting policy's evaluation, logged with the first step's metrics as eval_before/...
    before = ({f"eval_before/{k[5:]}": v for k, v in evaluator.run().items()}
              if evaluator is not None and spec.eval.before_training and start == 0 else {})
    before.update(schedule.weights.setup_metrics)  # the weight sync's setup, once: with this process's first step
    _keep_metrics_before(Path(run_dir) / "metrics.jsonl", start)
    from rlhf.track import MetricsFile

    metrics_file = MetricsFile(run_dir)  # a full disk or a deleted run dir: one line (rlhf.storage)
    from rlhf.run import StopRequest

    stop = StopRequest().install()  # Ctrl-C / SIGTERM: finish the step, checkpoint it, then stop
    # the role groups a step calls, looked up once (the cluster's properties find them by role name)
    actor, critic, teacher = cluster.actor, cluster.critic, cluster.teacher
    engines, reward_model = cluster.rollout.workers, cluster.reward_model
    next_save = ckpt.next_due(start, spec.train.steps)  # the step the next checkpoint follows
    try:
        with lean_driver(spec):  # the step loop's driver: no GC scans of setup objects, one thread on GPU
            for step in range(start, spec.train.steps):
                ph = Phases(spec, step)
                t_step = time.perf_counter()
                data_before = data.state_dict()  # a reward function's failure checkpoints the steps done

                # ---- generate + reward (dynamic sampling keeps only groups that teach something)
                try:
                    rows, prompt_ids, samples, scores, parts, ds_stats = sample_step(
                        spec, step, data, tokenizer, cluster, rewards, ph, prefetch, agent, engines=engines,
                        reward_model=reward_model)
                except RewardError as e:
                    raise keep_steps_done(e, spec, step, start, cluster, data, data_before, ckpt, kl_ctl, history,
                                          run_dir, console) from None
                multi_turn = spec.env.fn is not None or agent is not None
                width = None if multi_turn else spec.rollout.max_response_tokens
                batch = collate([prompt_ids[s.prompt_index] for s in samples], [s.response_ids for s in samples],
                                tokenizer.pad_token_id, width)
                mask = batch["response_mask"]
                if multi_turn:  # environment feedback, the template's ids and tool answers carry no loss
                    from rlhf.envs.rollout import env_loss_mask

                    batch["response_mask"] = mask = mask * env_loss_mask(samples, mask.shape[1])
                batch["rollout_logp"] = _pad_logprobs(samples, mask.shape[1])
                with ph("to_train"):  # hybrid GPU placement: vLLM sleeps, DeepSpeed's states come back
                    phase_stats = schedule.to_train()

                # ---- reference log-probs, old log-probs, values
                if use_ref:
                    with ph("reference"):
                        batch["ref_logp"] = dp_forward(*reference, batch)
                if teacher is not None:  # on-policy distillation: the teacher scores the samples
                    with ph("teacher"):
                        batch["teacher_logp"] = dp_forward(teacher, TeacherWorker.logprobs, batch)
                if need_old_logp:
                    with ph("old_logp"):
                        batch["old_logp"] = dp_forward(actor, PolicyWorker.logprobs, batch)
                values = None
                if critic is not None:
                    with ph("critic"):
                        values = dp_forward(critic, CriticWorker.values, batch)
                        batch["old_values"] = values

                # ---- advantages
                with ph("advantages"):
                    adv_metrics = add_advantages(spec, batch, scores, values, kl_ctl, samples, objective)

                # ---- update policy (and critic), then sync the rollout engines
                with ph("update"):
                    plans = update_plan(spec, batch, step)
                    refs = scatter_update(actor, PolicyWorker.update, batch, plans, spec)
                    if critic is not None:
                        refs_c = scatter_update(critic, CriticWorker.update, batch, plans, spec)
                    if prefetch is not None:  # async: the engines sample the next steps during this update
                        prefetch.launch_ahead(step)
                    actor_stats = combine(_get(refs))
                    critic_stats = combine(_get(refs_c)) if critic is not None else {}
                    if prefetch is not None:
                        prefetch.update_done()
                if kl_in_reward:
                    kl_ctl.update(adv_metrics.get("kl/mean", 0.0), B.samples_per_step)
                with ph("sync"):  # caches freed, vLLM wakes, weights sent, DeepSpeed's states offloaded
                    phase_stats.update(schedule.to_generate())

                # ---- log
                ph.times["step"] = time.perf_counter() - t_step
                m = step_metrics(spec, samples, scores, parts, mask, ph.times)
                m.update(adv_metrics)
                m.update(actor_stats)
                m.update(critic_stats)
                m.update(ds_stats)
                m.update(phase_stats)
                if "old_logp" in batch:  # the engine's sampled-token log-probs against the trainer's
                    m.update(algos.logprob_mismatch(batch["rollout_logp"], batch["old_logp"], mask))
                if spec.hardware.peak_bf16_tflops > 0 and "perf/update_tflops" in m:
                    m["perf/mfu"] = m["perf/update_tflops"] / spec.hardware.peak_bf16_tflops
                    m["perf/fwd_bwd_mfu"] = m["perf/fwd_bwd_tflops"] / spec.hardware.peak_bf16_tflops
                if values is not None:
                    m["critic/explained_variance"] = explained_variance(values, batch["returns"], mask)
                m["kl/coef"] = kl_ctl.value
                m.update(before)
                before = {}
                evaluated = evaluator is not None and evaluator.due(step, ckpt)
                if evaluated:
                    t_eval = time.perf_counter()
                    m.update(evaluator.run())
                    m["time/eval"] = time.perf_counter() - t_eval
                history.append(m)
                n = step + 1  # steps count from 1 in the console, metrics.jsonl and every tracker
                metrics_file.write({"step": n, **m})
                if step % spec.tracking.log_every == 0 or n == spec.train.steps or evaluated:
                    tracker.log(n, m)
                console.step(n, m)
                saving = dict(ckpt=ckpt, kl_ctl=kl_ctl, history=history, run_dir=run_dir, console=console)
                maybe_checkpoint(spec, step, cluster, data, due=n == next_save, **saving)
                if n == next_save:
                    next_save = ckpt.next_due(n, spec.train.steps)
                if stop.requested and step + 1 < spec.train.steps:  # a signal came during this step
                    if ckpt.last_saved != step + 1:
                        maybe_checkpoint(spec, step, cluster, data, force=True, **saving)
                    console.print(f"stopped after step {step + 1}: continue with {resume_command(run_dir)}")
                    raise stop.exception()
            if start >= spec.train.steps and not (Path(run_dir) / "final" / "hf").is_dir():  # its export had failed
                console.print(f"saved {ckpt_io.export_final(spec, cluster, run_dir)} (HF format)")
    finally:
        stop.restore()
        metrics_file.close()
        rewards.close()
        if prefetch is not None:
            prefetch.close()
        if agent is not None:
            agent.close()
    return summarize(history)


# ----------------------------------------------------------------------------- generation + reward


def sample_step(spec: RunSpec, step, data, tokenizer, cluster: Cluster, rewards, ph, prefetch=None, agent=None, *,
                engines: list, reward_model: Optional[ActorGroup]):
    """Rows, prompt ids, samples and scores of exactly ``prompts_per_step`` groups (``agent``: an
    ``rlhf.agent.rollout.AgentRollout`` rolls the prompts out as chats with tool calls). ``engines``:
    the rollout workers' handles; ``reward_model``: its group, or None (the cluster's, looked up
    once by the loop).

    With ``algo.dynamic_sampling`` (DAPO) groups whose scores are all equal are dropped and more
    prompts are drawn, up to 4 rounds; if still short, dropped groups fill the batch (their
    advantage is zero, so they add no gradient) and ``data/filled_groups`` says how many.
    """
    P, G = spec.batch.prompts_per_step, spec.algo.group_size
    kept: list[tuple[dict, list[int], list[Sample], list[float], dict]] = []
    dropped: list = []
    rounds = 4 if spec.algo.dynamic_sampling else 1
    for r in range(rounds):
        with ph("generate"):
            ahead = prefetch.take(step) if prefetch is not None else None  # async: sampled during the last update
        if ahead is not None:
            rows, prompt_ids, samples = ahead
        else:
            rows = data.next(P)
            prompt_ids = tokenize_prompts(spec, tokenizer, rows) if agent is None else []
        with ph("generate"):
            if agent is not None:  # the chat template renders the prompts; ids come back with the trajectories
                samples, prompt_ids, agent_stats = agent.run(rows, sampling_for(spec, step, r * P, len(rows)))
            elif ahead is None:
                samples = generate(engines, prompt_ids, sampling_for(spec, step, r * P, len(prompt_ids)))
            if spec.env.fn is not None:  # multi-turn (rlhf.envs): the environment answers and scores
                from rlhf.envs.rollout import env_rollout

                samples, env_scores, env_parts, env_stats = env_rollout(spec, step, rows, prompt_ids, tokenizer,
                                                                        cluster, samples)
        with ph("reward"):
            if spec.env.fn is not None:
                scores, parts = env_scores, env_parts
            elif agent is not None:
                scores, parts = agent.score(rows, samples, rewards, cluster, prompt_ids)
            else:
                scores, parts = score_samples(spec, rows, samples, tokenizer, rewards, reward_model, prompt_ids)
        keep = torch.ones(len(samples), dtype=torch.bool)
        if spec.algo.dynamic_sampling:
            keep, _ = algos.dynamic_sampling_filter(scores, G)
        for i in range(P):
            sl = slice(i * G, (i + 1) * G)
            group = (rows[i], prompt_ids[i], samples[sl], scores[sl].tolist(), {k: v[sl] for k, v in parts.items()})
            (kept if bool(keep[i * G]) else dropped).append(group)
        if len(kept) >= P:
            break
    n_kept = min(len(kept), P)
    groups = kept[:P] + dropped[: P - n_kept]
    rows = [g[0] for g in groups]
    prompt_ids = [g[1] for g in groups]
    samples = []
    for i, g in enumerate(groups):
        for s in g[2]:
            s.prompt_index = i
            samples.append(s)
    scores = torch.tensor([x for g in groups for x in g[3]], dtype=torch.float32)
    parts = {k: [x for g in groups for x in g[4][k]] for k in (groups[0][4] if groups else {})}
    stats = {}
    if spec.algo.dynamic_sampling:
        stats = {"data/kept_groups": float(n_kept), "data/filled_groups": float(P - n_kept),
                 "data/sampling_rounds": float(r + 1)}
    if spec.env.fn is not None:
        stats.update(env_stats)
    if agent is not None:
        stats.update(agent_stats)  # of the last sampling round
    if prefetch is not None:
        stats.update(prefetch.last)
    return rows, prompt_ids, samples, scores, parts, stats


def _pad_logprobs(samples: list[Sample], width: int) -> torch.Tensor:
    return padded_rows([s.logprobs for s in samples], width, 0.0, left=False, dtype=torch.float32)[0]


# ----------------------------------------------------------------------------- data parallel calls


def update_plan(spec: RunSpec, batch: Batch, step: int) -> list[tuple[torch.Tensor, float]]:
    """(rows, global loss denominator) of every optimizer step of this rollout batch.

    The order does not depend on the number of ranks: one mini-batch and one epoch keep the
    sampled order; otherwise every epoch is a seeded permutation cut into mini-batches.
    """
    algo = spec.algo
    n = size(batch)
    mini = spec.batch.mini_batch_size if n == spec.batch.samples_per_step else n
    plan = []
    for epoch in range(algo.epochs):
        if mini == n and algo.epochs == 1:
            order = torch.arange(n)
        else:
            g = torch.Generator().manual_seed(spec.train.seed * 7919 + step * 104729 + epoch)
            order = torch.randperm(n, generator=g)
        for k in range(n // mini):
            rows = order[k * mini:(k + 1) * mini]
            den = algos.aggregation_denominator(batch["response_mask"][rows], algo.loss_agg,
                                                spec.rollout.max_response_tokens)
            plan.append((rows, den))
    return plan


UPDATE_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "advantages", "returns",
               "old_logp", "ref_logp", "rollout_logp", "old_values")


def scatter_update(group: Any, update: Any, batch: Batch, plan, spec: RunSpec) -> list:
    """``update`` (``PolicyWorker.update`` or ``CriticWorker.update``) on every rank: rank r gets
    its contiguous share of every optimizer step's rows, steps one after another."""
    W = group.world_size
    slim = {k: v for k, v in batch.items() if k in UPDATE_KEYS}
    per_rank: list[list[Batch]] = [[] for _ in range(W)]
    for rows, _ in plan:
        part = len(rows) // W
        for r in range(W):
            per_rank[r].append(select(slim, rows[r * part:(r + 1) * part]))
    dens = [d for _, d in plan]
    return group.scatter_async(update, [concat(p) for p in per_rank], dens)


def _get(refs):
    import ray

    return ray.get(refs)


def combine(stats: list[dict[str, tuple[float, float]]]) -> dict[str, float]:
    """Weighted means over ranks (``{name: (sum, weight)}``); ``*_max`` names take the maximum."""
    out: dict[str, float] = {}
    for k in dict.fromkeys(k for st in stats for k in st):
        if k.endswith("_max"):
            out[k] = max(st[k][0] for st in stats if k in st)
            continue
        s = sum(st[k][0] for st in stats if k in st)
        c = sum(st[k][1] for st in stats if k in st)
        out[k] = s / c if c else 0.0
    return out


# ----------------------------------------------------------------------------- advantages + metrics


def add_advantages(spec: RunSpec, batch: Batch, scores: torch.Tensor, values, kl_ctl, samples,
                   objective: Optional[Objective] = None) -> dict[str, float]:
    """The objective's advantages (and returns for PPO) into ``batch`` (``objective``: the run's
    ``rlhf.algos.objective.Objective``, made here if not given); its metrics."""
    mask = batch["response_mask"]
    ref = "ref_logp" in batch
    student_logp = batch["old_logp"] if "old_logp" in batch else batch.get("rollout_logp")
    adv = (objective or Objective(spec.algo)).advantages(
        scores=scores, mask=mask, truncated=torch.tensor([s.finish_reason == "length" for s in samples]),
        max_response_tokens=spec.rollout.max_response_tokens, values=values,
        policy_logp=student_logp if ref else None,
        ref_logp=batch["ref_logp"] if ref else None, kl_coef=kl_ctl.value,
        teacher_logp=batch.get("teacher_logp"), student_logp=student_logp)
    batch["advantages"] = adv.advantages
    if adv.returns is not None:
        batch["returns"] = adv.returns
    return adv.metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    var_r = float(algos.masked_var(returns, mask))
    if var_r == 0:
        return 0.0
    return 1.0 - float(algos.masked_var(returns - values, mask)) / var_r


def step_metrics(spec: RunSpec, samples: list[Sample], scores: torch.Tensor, parts: dict, mask: torch.Tensor,
                 times: dict[str, float]) -> dict[str, float]:
    lengths = mask.sum(-1)
    m = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "reward/min": float(scores.min()),
        "reward/max": float(scores.max()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncation_rate": sum(s.finish_reason == "length" for s in samples) / max(len(samples), 1),
    }
    for name, vals in parts.items():
        m[f"reward/{name}/mean"] = sum(vals) / max(len(vals), 1)
    for name, t in times.items():
        m[f"time/{name}"] = t
    tokens = float(lengths.sum())
    m["throughput/tokens_per_s"] = tokens / max(times["step"], 1e-9)
    m["throughput/samples_per_s"] = len(samples) / max(times["step"], 1e-9)
    if times.get("generate"):
        m["throughput/generate_tokens_per_s"] = tokens / times["generate"]
    return m


def maybe_checkpoint(spec: RunSpec, step: int, cluster: Cluster, data: Any, ckpt=None, kl_ctl=None, history=None,
                     run_dir: Optional[str] = None, console: Optional[Console] = None, force: bool = False,
                     due: Optional[bool] = None) -> None:
    """Checkpoint hook: the full training state every ``checkpoint.every`` steps, at the end and
    when ``force`` (a stop on Ctrl-C / SIGTERM) (``rlhf.ckpt.training``), and the final HF export
    ``<run_dir>/final/hf`` at the end. ``due``: whether ``ckpt`` saves after this step (the loop
    knows its next save, ``CheckpointManager.next_due``), asked of ``ckpt`` when not given."""
    if ckpt is None:
        return
    done, last = step + 1, spec.train.steps
    if due is None:
        due = ckpt.due(done, last)
    if due or force:
        state = {"step": done, "data": data.state_dict(), "kl": kl_ctl.state_dict(), "history": list(history)}
        path = ckpt_io.save(spec, ckpt, done, cluster, state, metrics=history[-1] if history else None)
        if console is not None:
            console.print(f"checkpoint: {path}")
            best = spec.checkpoint.best_metric
            if best and not force and history and best not in history[-1] and not ckpt.unranked_warned:
                ckpt.unranked_warned = True
                console.print(f"warning: checkpoint.best_metric={best} is not a metric of step {done}, so no "
                              "checkpoint is kept as the best (eval metrics need eval.every > 0; e.g. "
                              "eval/greedy/reward_mean)")
    if done == last:
        final = ckpt_io.export_final(spec, cluster, run_dir)
        if console is not None:
            console.print(f"saved {final} (HF format)")


def keep_steps_done(e: RewardError, spec: RunSpec, step: int, start: int, cluster: Cluster, data: Any, data_before: dict,
                    ckpt, kl_ctl, history: list, run_dir: str, console: Console) -> RewardError:
    """A reward function failed in step ``step`` (0-based) before the update: the cluster is fine
    and holds the policy of the steps done, so they are checkpointed (unless they are already:
    saved by this run, or the checkpoint it resumed from) with the data position they ended at,
    and the error says how to continue."""
    if step == 0 or ckpt is None:
        return e
    if step != start and ckpt.last_saved != step:
        data.load_state_dict(data_before)
        maybe_checkpoint(spec, step - 1, cluster, data, ckpt=ckpt, kl_ctl=kl_ctl, history=history, run_dir=run_dir,
                         console=console, force=True)
    done = "Step 1 is" if step == 1 else f"Steps 1-{step} are"
    return RewardError(f"{str(e).rstrip('.')}. {done} checkpointed: fix it, then continue with "
                       f"{resume_command(run_dir)}")


def _keep_metrics_before(path: Path, start: int) -> None:
    """A resumed run rewrites its metrics after ``start`` steps: keep the lines of steps 1..start."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= start]
    path.write_text("".join(line + "\n" for line in keep))


def summarize(history: list[dict[str, float]]) -> dict[str, float]:
    if not history:
        return {}
    k = max(1, len(history) // 5)
    first = sum(h["reward/mean"] for h in history[:k]) / k
    last = sum(h["reward/mean"] for h in history[-k:]) / k
    return {"reward/first_fifth": first, "reward/last_fifth": last, "steps": float(len(history))}

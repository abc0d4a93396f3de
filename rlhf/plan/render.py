"""The plan: what a run will do, printed before anything starts (no Ray, no torch, no GPU).

    rlhf-run algo=grpo model=llama3-8b hardware=8xh100 --plan

It shows what differs from the defaults, the batch math, which device holds which role, the
memory per GPU by phase (hybrid) or role (disaggregated) with the parts that make it up, the disk
the checkpoints and the final export take under output_dir (``rlhf.plan.disk``), and warnings: a
figure that will not fit (with what to change), vLLM weights that leave no KV cache, idle devices.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from rlhf.plan.advice import apply, merge_overrides, setting_that_fits, suggestions
from rlhf.plan import disk, memory
from rlhf.plan.memory import (
    HOST,
    training_figure,
    Estimate,
    estimate,
    fits,
    lora_param_count,
    min_gpus,
    over_limit,
    param_count,
)
from rlhf.rollout import registry as engines
from rlhf.spec.runspec import RunSpec
from rlhf.spec.shape import shape_line
from rlhf.storage import human, unit_of


def ranges(devs: tuple[int, ...]) -> str:
    """Device or rank numbers as the plan prints them: ``0-3`` for a run, ``0,2,5`` otherwise."""
    if not devs:
        return "-"
    if len(devs) > 1 and list(devs) == list(range(devs[0], devs[-1] + 1)):
        return f"{devs[0]}-{devs[-1]}"
    return ",".join(str(d) for d in devs)


def _parts(parts: dict[str, float]) -> str:
    shown = [f"{k} {v:.1f}" for k, v in parts.items() if v >= 0.05]
    return " + ".join(shown) or "0"


def _advice(spec: RunSpec, est: Estimate, name: str) -> str:
    """What to change when the figure ``name`` does not fit: settings checked by building them
    (rlhf.plan.advice), each with the figure it gives."""
    tips = []
    for s in suggestions(spec, est, name):
        tips.append(f"{' '.join(s.overrides)} ({'fits, ' if s.fits else ''}{s.total:.0f} GB)")
    if tips:
        return "Try " + "; ".join(tips) + "."
    if training_figure(name) and not min_gpus(spec, est, name):
        return "Use a smaller model or sequence length: activations and runtime alone do not fit."
    if name == HOST:
        if max(est.host, key=est.host.get) == "model loading":
            return ("Every training process on a node loads the whole model on the host (float32 for a trained "
                    "one): use a smaller model, fewer GPUs per node, or nodes with more host memory.")
        return "Use LoRA, more GPUs (less optimizer state per node), or hardware with more host memory."
    return "Use more GPUs or a smaller model."


def warnings(spec: RunSpec, est: Estimate) -> list[str]:
    out = []
    hw, lay = spec.hardware, spec.layout
    if hw.accelerator == "cuda":
        over = over_limit(spec, est)
        for name, total in over.items():
            if name != HOST:
                what = f"the {name}" if name.endswith("phase") else f"each {name} GPU"
                if name == "training phase" and memory.overlaps_update(spec):  # async: the engine is part of it
                    what = (f"algo.async_steps={spec.algo.async_steps} keeps {spec.rollout_engine} awake beside the "
                            f"update (its {_engine_gb(spec, est):.1f} GB), so {what}")
                out.append(
                    f"✗ does not fit: {what} needs ~{total:.0f} GB, the GPU has {hw.device_memory_gb:g} GB "
                    f"({memory.FIT_MARGIN:.0%} usable). {_advice(spec, est, name)}"
                )
        if HOST in over:
            big = max(est.host, key=est.host.get)
            out.append(
                f"✗ does not fit: the host memory needs ~{est.total(HOST):.0f} GB per node "
                f"(most of it {big}, {est.host[big]:.0f} GB), the node has {hw.host_memory_gb:g} GB "
                f"({memory.HOST_FIT_MARGIN:.0%} usable; hardware.host_memory_gb). {_advice(spec, est, HOST)}"
            )
        for name, parts in est.figures.items():
            weights = parts.get("vLLM weights", 0.0)
            share = spec.rollout.gpu_memory_utilization * hw.device_memory_gb
            if weights and weights >= share and name not in over:
                n = lay.engines_per_device
                whose = f"{n} engines' weights" if n > 1 else "vLLM's weights"
                out.append(
                    f"✗ {whose} ({weights:.1f} GB per GPU at TP {lay.rollout_tp}) fill its whole share "
                    f"(rollout.gpu_memory_utilization={spec.rollout.gpu_memory_utilization:g} × "
                    f"{hw.device_memory_gb:g} GB = {share:.1f} GB): no room for a KV cache. {_advice(spec, est, name)}"
                )
    if hw.accelerator == "cuda" and spec.train.zero_stage == 3 and spec.batch.train_world_size == 1:
        out.append("! train.zero_stage=3 with 1 rank shards nothing and gathers the weights in every pass "
                   "(slower than ZeRO-1). Leave train.zero_stage at auto, or set 1.")
    used: set[int] = set()
    for devs in lay.roles.values():
        used.update(devs)
    idle = lay.total_devices - len(used)
    if idle > 0:
        out.append(
            f"! {idle} of {lay.total_devices} devices hold no role (idle): raise the per-role counts "
            "(placement.actor, placement.rollout.engines, ...) or use placement=hybrid."
        )
    if lay.one_pool and lay.engines and len(lay.rollout_devices) < lay.total_devices:
        spare = lay.total_devices - len(lay.rollout_devices)
        out.append(
            f"! {spare} devices run no rollout engine (placement.rollout.engines={len(lay.engines)} × "
            f"tensor_parallel={lay.rollout_tp}); they idle while the others generate. "
            "Use placement.rollout.engines=0 (as many as fit)."
        )
    return out


def _engine_gb(spec: RunSpec, est: Estimate) -> float:
    """GB per GPU the rollout engine keeps through hybrid's training phase (its kind's parts)."""
    parts = engines.kind(spec).memory_parts()
    return sum(v for k, v in est.figures.get("training phase", {}).items() if k in parts)


def async_line(spec: RunSpec, est: Estimate) -> Optional[str]:
    """What ``algo.async_steps`` > 0 does and costs: how stale a batch is, its correction, and where
    the overlap comes from (an engine awake beside the update, devices of their own, a process of its own)."""
    k = getattr(spec.algo, "async_steps", 0)
    if k <= 0 or "rollout" not in spec.roles:
        return None
    tis = f"truncated IS, algo.tis_cap={spec.algo.tis_cap:g}"
    head = f"async: step t+1{'…t+' + str(k) if k > 1 else ''} sampled during step t's update (≤ {k} update{'s' if k > 1 else ''} stale; {tis})"
    if memory.overlaps_update(spec):
        # where async fits, the synchronous run at the same budget holds the engine awake too (auto)
        sync = apply(spec, ["algo.async_steps=0"])
        than = "; awake with algo.async_steps=0 too" if sync is not None and not sync.placement.sleep_rollout else ""
        cost = (f"{spec.rollout_engine} stays awake beside the update: the training phase holds its "
                f"{_engine_gb(spec, est):.1f} GB per GPU too ({est.total('training phase'):.1f} GB{than}); "
                "no sleep or wake, and the training states stay on the GPU between updates")
    elif spec.layout.rollout_beside_training:  # CPU
        cost = "the rollout engines run in processes of their own, beside the trainers', so that they generate during the update"
    else:
        cost = "the engines have devices of their own: no memory cost"
    return f"{head} · {cost}"


def _amount(gb: float) -> str:
    """GB as the disk lines print it (``rlhf.storage.human``)."""
    return human(gb * memory.GB)


def _rounded_up(gb: float) -> str:
    """GB rounded up to a whole number of ``human``'s unit: "≥ 59 GB free"."""
    unit, size = unit_of(gb * memory.GB)
    return f"{math.ceil(gb * memory.GB / size)} {unit}"


def disk_line(spec: RunSpec, need: disk.DiskNeed, available: Optional[int]) -> str:
    """``disk at <run dir> (output_dir | hydra.run.dir): <n> checkpoint(s) × (parts) + final export
    (parts) = X GB of Y GB free``, the parts in the unit of the total (MB for the CPU runs); for
    sft/rm/dpo with ``checkpoint.every`` > 0, where the save count came from: ``· ≤ 2 saves in ≤ 4
    steps of 64 training rows``, or rotation's worst case where the rows are not counted."""
    size = unit_of(need.total * memory.GB)[1]

    def sizes(parts: dict[str, float]) -> str:
        return " + ".join(f"{k} {v * memory.GB / size:.1f}" for k, v in parts.items())

    n = need.checkpoints
    text = f"{n} checkpoint{'s ×' if n > 1 else ''} ({sizes(need.checkpoint)})"
    if need.final:
        text += f" + final export ({sizes(need.final)})"
    free = f"of {human(available)} free" if available is not None else "(free space unknown)"
    where = f"{spec.run_dir} ({'output_dir' if spec.output_dir else 'hydra.run.dir'})"
    counted = ""
    if spec.algo.kind != "rl" and spec.checkpoint.every > 0:
        b, n = need.steps, need.saves
        if b is not None and n is not None:
            counted = (f" · ≤ {n} save{'s' if n != 1 else ''} in ≤ {b.steps} step{'s' if b.steps != 1 else ''} "
                       f"of {b.rows} training rows")
        else:
            counted = " · steps from the data, not counted before reading it: as many checkpoints as rotation keeps"
    return f"disk at {where}: {text} = {_amount(need.total)} {free}{counted}"


def disk_warning(spec: RunSpec, need: disk.DiskNeed, available: Optional[int],
                 tips: Optional[list[tuple[tuple[str, ...], float]]] = None) -> Optional[str]:
    """The "✗ does not fit" line of a run whose checkpoints and export need more than
    DISK_FIT_MARGIN of the space free under its output_dir, with settings checked to fit (``tips``:
    ``disk.suggestions`` of the spec, when computed already); else None."""
    if not disk.over(need, available):
        return None
    what = f"{need.checkpoints} checkpoint{'s' if need.checkpoints > 1 else ''} of {_amount(need.per_checkpoint)}"
    if need.final:
        what += f" and the final export of {_amount(sum(need.final.values()))}"
    if tips is None:
        tips = disk.suggestions(spec, available)
    tried = "; ".join(f"{' '.join(o)} ({_amount(gb)})" for o, gb in tips)
    return (f"✗ does not fit: the disk at {spec.run_dir} needs ~{_amount(need.total)} ({what}), "
            f"{human(available)} free there ({disk.DISK_FIT_MARGIN:.0%} usable). "
            f"Give output_dir= a path on a disk with ≥ {_rounded_up(need.total / disk.DISK_FIT_MARGIN)} free"
            + (f", or set {tried}." if tried else "."))


def fitting_setting(spec: RunSpec, est: Estimate, available: Optional[int],
                    tips: Optional[list[tuple[tuple[str, ...], float]]]) -> Optional[tuple[str, ...]]:
    """Overrides that make every GPU figure (``setting_that_fits``) and then the disk fit: ``tips``
    (the spec's ``disk.suggestions``; None where its disk fits) when the GPU figures fit as they
    are, else the suggestions for the spec with the GPU fix. None when none is found."""
    fix: tuple[str, ...] = ()
    if not fits(spec, est):
        found = setting_that_fits(spec)
        if found is None:
            return None
        fix, cur = found
        tips = disk.suggestions(cur, available) if disk.over(disk.need(cur), available) else None
    if tips is None:
        return fix
    return merge_overrides(fix, tips[0][0]) if tips else None


def _decisions(spec: RunSpec) -> list[str]:
    """One line per value the build chose (rlhf.plan.auto), with its reason."""
    shown = {
        "train.zero_stage": lambda v: f"ZeRO-{v}",
        "train.offload_optimizer": lambda v: "optimizer offloaded" if v else "optimizer on the GPU",
        "placement.sleep_rollout": lambda v: "vLLM sleeps during training" if v else "vLLM stays awake during training",
        "placement.offload_train_state": lambda v: (
            "training states offloaded while vLLM generates" if v else "training states stay on the GPU while vLLM generates"),
        "rollout.seeded": lambda v: "a seed per prompt" if v else "rollout requests unseeded",
        "model.liger_kernels": lambda v: f"Liger kernels {'on' if v else 'off'}",
        "placement.rollout.engines_per_device": lambda v: f"{v} rollout engine{'s' if v > 1 else ''} per GPU",
        "model.compile_layers": lambda v: f"decoder layers {'compiled' if v else 'eager'}",
    }
    return [f"  {shown[d.key](d.value)} (auto: {d.why})" for d in getattr(spec, "auto", ()) if d.why and d.key in shown]


def render_plan(spec: RunSpec) -> str:
    a, b, hw, lay = spec.algo, spec.batch, spec.hardware, spec.layout
    gpu = hw.accelerator == "cuda"
    lines = [
        f"run: {a.name} · {spec.placement.mode} · {spec.model.name} · {hw.name} "
        f"({hw.nodes} node{'s' if hw.nodes > 1 else ''} × {hw.devices_per_node} {'GPU' if gpu else 'CPU slot'}"
        + (f", {hw.device_memory_gb:g} GB each" if gpu else "")
        + ")"
    ]
    changes = getattr(spec, "changes", ()) or ()
    if changes:
        lines.append("changed from the defaults:")
        lines.extend(f"  {c}" for c in changes)
    else:
        lines.append("changed from the defaults: nothing")

    p = param_count(spec.model)
    ckpt = " · gradient checkpointing" if spec.model.gradient_checkpointing else ""
    size = f"{p / 1e9:.2f} B" if p >= 1e8 else f"{p / 1e6:.2f} M"
    lora = spec.model.lora
    if lora.rank > 0:
        n = lora_param_count(spec.model)
        trained = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
        ckpt += (f" · LoRA r={lora.rank} α={lora.alpha:g} on {','.join(lora.target_modules)}"
                 f" ({trained} trained parameters)")
    lines.append(f"model: {spec.model.path} · {size} parameters · {spec.model.dtype}{ckpt}")
    read = shape_line(spec)
    if read:
        lines.append(read)
    if "teacher" in spec.roles:  # on-policy distillation: the teacher, where it is and how it stays
        from rlhf.plan.memory import teacher_of, teacher_offloaded

        tm, tt = teacher_of(spec), spec.algo.teacher
        n = param_count(tm)
        where = ("offloaded to host memory while the engines generate" if teacher_offloaded(spec)
                 else "resident" if spec.layout.one_pool else f"own devices {list(spec.layout.roles['teacher'])}")
        div = f"jsd β={tt.beta:g}" if tt.divergence == "jsd" else tt.divergence
        lines.append(f"teacher: {tt.path} · {n / 1e9:.2f} B parameters · {tm.dtype} · {div} × {tt.coef:g} · {where}"
                     if n >= 1e8 else f"teacher: {tt.path} · {n / 1e6:.2f} M parameters · {tm.dtype} · {div} × "
                     f"{tt.coef:g} · {where}")
    t = spec.train.max_tokens_per_micro_batch
    # sft/rm/dpo: what their micro-batch holds (rlhf.spec.tokens), as the build decided it
    decided = next((d.why for d in spec.auto if d.key == "train.max_tokens_per_micro_batch"), None)
    if a.kind == "rl":  # null: how the build chose it (rlhf.plan.auto._token_budget on GPUs)
        knob = f"train.max_tokens_per_micro_batch null: {decided}" if decided else "train.max_tokens_per_micro_batch"
    else:
        knob = decided or "train.micro_batch_size × data.max_length"
    tokens = f" · ≤ {t} tokens per micro-batch ({knob})"
    lines.extend(_hub_lines(spec))
    if a.kind == "rl":
        kl = f"KL {a.kl.estimator} × {a.kl.coef:g} in the {a.kl.placement}" if a.kl.coef > 0 else "no KL"
        critic = f" · critic lr {a.critic.lr:g}" if a.critic is not None else ""
        lines.append(
            f"algorithm: {a.name} · advantages {a.estimator} · loss {a.loss_agg} · clip [{a.clip_low:g}, "
            f"{a.clip_high:g}] · {kl} · lr {a.lr:g}{critic}"
        )
        lines.append(
            f"batch: {b.prompts_per_step} prompts × {b.group_size} samples = {b.samples_per_step} samples/step → "
            f"{b.optimizer_steps_per_step} optimizer step(s) of {b.mini_batch_size} "
            f"(micro {b.micro_batch_size} × {b.grad_accum} accum × {b.train_world_size} ranks){tokens}"
        )
        lines.append(
            f"rollout: {spec.rollout_engine} · {spec.rollout.max_prompt_tokens} prompt + "
            f"{spec.rollout.max_response_tokens} response tokens · temperature {spec.rollout.temperature:g}"
        )
    else:
        extra = f" · beta {a.beta:g} · loss {a.loss_type}" if a.kind == "dpo" else ""
        lines.append(f"algorithm: {a.name} · lr {a.lr:g}{extra}")
        # kto trains on unpaired examples (rlhf.loops.dpo.prepare): a step counts those, not pairs
        unit = "examples" if a.kind == "sft" or getattr(a, "loss_type", None) == "kto" else "pairs"
        lines.append(
            f"batch: {b.prompts_per_step} {unit} per optimizer step "
            f"(micro {b.micro_batch_size} × {b.grad_accum} accum × {b.train_world_size} ranks){tokens}"
        )
    offload = " · optimizer offloaded" if spec.train.offload_optimizer else ""
    length = f"steps: {spec.train.steps}" if a.kind == "rl" else f"epochs: {a.epochs}"
    lines.append(f"{length} · ZeRO-{spec.train.zero_stage}{offload} · seed {spec.train.seed}")
    lines.extend(_decisions(spec))

    lines.append(f"placement ({lay.mode}, {lay.total_devices} device{'s' if lay.total_devices > 1 else ''}):")
    if lay.one_pool:
        trained = [r for r in spec.roles if r != "rollout"]
        shards = f" (ZeRO-{spec.train.zero_stage} shards)" if spec.train.zero_stage == 3 else ""
        lines.append(f"  device {ranges(tuple(range(lay.total_devices)))}: {', '.join(trained)}{shards}")
    else:
        for pool in lay.pools:
            if "rollout" not in pool:
                lines.append(f"  device {ranges(lay.roles[pool[0]])}: {', '.join(pool)}")
    # engines that share a device (placement.rollout.engines_per_device) on one line
    held: list[tuple[tuple[int, ...], list[int]]] = []
    for i, devs in enumerate(lay.engines):
        if held and held[-1][0] == devs:
            held[-1][1].append(i)
        else:
            held.append((devs, [i]))
    shown: list[Any] = list(held)
    if len(shown) > 4:
        shown = shown[:2] + [None] + shown[-1:]
    for item in shown:
        if item is None:
            lines.append(f"  ... {len(lay.engines)} engines in all")
            continue
        devs, ids = item
        tp = f" (TP {len(devs)})" if len(devs) > 1 else ""
        what = f"engine {ids[0]}" if len(ids) == 1 else f"engines {ranges(tuple(ids))} (a process each)"
        lines.append(f"  device {ranges(devs)}: {spec.rollout_engine} {what}{tp}")
    if hw.nodes > 1:
        lines.extend(_node_lines(spec))

    est = estimate(spec)
    overlap = async_line(spec, est)
    if overlap:
        lines.append(overlap)
    if gpu:
        lines.append("memory per GPU (GB; formulas in docs/memory.md):")
        for name, parts in est.figures.items():
            lines.append(f"  {name + ':':<18}{_parts(parts)} = {est.total(name):.1f} of {hw.device_memory_gb:g}")
        if est.host:
            lines.append(f"host memory per node: {_parts(est.host)} = {est.total(HOST):.1f} of {hw.host_memory_gb:g}")
        else:
            lines.append("host memory per node: not checked (hardware.host_memory_gb=0)")
    else:
        lines.append(f"memory: CPU run; model states ~{_cpu_host_gb(spec, est):.2f} GB of host memory")
    need, available = disk.need(spec), disk.available_bytes(spec)
    lines.append(disk_line(spec, need, available))
    lines.extend(warnings(spec, est))
    tips = disk.suggestions(spec, available) if disk.over(need, available) else None
    on_disk = disk_warning(spec, need, available, tips)
    if on_disk:
        lines.append(on_disk)
    ok = fits(spec, est) and on_disk is None
    if not ok:
        fix = fitting_setting(spec, est, available, tips)
        if fix:
            lines.append(f"→ a setting that fits: {' '.join(fix)}")
    if gpu or not ok:
        lines.append("✓ fits" if ok else "✗ does not fit (see above)")
    return "\n".join(lines)


def _cpu_host_gb(spec: RunSpec, est: Estimate) -> float:
    """What a CPU run's processes hold, all on the host: hybrid's training phase (every role of a
    device), or disaggregated's figure of each role (a teacher's, a reference's, ...) times its devices."""
    if "training phase" in est.figures:
        return est.total("training phase")
    roles = spec.layout.roles
    return sum(est.total(name) * len({d for r in name.split(" + ") for d in roles.get(r, ())} or {0})
               for name in est.figures)


def _node_lines(spec: RunSpec) -> list[str]:
    """The per-node map: which ranks of each role each node holds (as the launcher reserves them)."""
    from rlhf.spec.nodes import node_ranks

    hw = spec.hardware
    unit = "GPUs" if hw.accelerator == "cuda" else "CPU slots"
    out = [f"nodes ({hw.nodes} × {hw.devices_per_node} {unit}; the driver's Ray node is node 0):"]
    for k, held in enumerate(node_ranks(spec)):
        devs = tuple(range(k * hw.devices_per_node, (k + 1) * hw.devices_per_node))
        parts = []
        for role, ranks in held.items():
            if role == "rollout":
                tp = f" (TP {spec.layout.rollout_tp})" if spec.layout.rollout_tp > 1 else ""
                parts.append(f"{spec.rollout_engine} engine{'s' if len(ranks) > 1 else ''} {ranges(ranks)}{tp}")
            else:
                parts.append(f"{role} rank{'s' if len(ranks) > 1 else ''} {ranges(ranks)}")
        out.append(f"  node {k} (devices {ranges(devs)}): {', '.join(parts) or 'idle'}")
    return out


def _hub_lines(spec: RunSpec) -> list[str]:
    """Where Hub ids of the run come from: the HF cache (at which commit), or a download at start."""
    import os

    from rlhf.hub import cached_commit, hub_cache, is_repo_id

    out = []
    for key, path, rev in (("model.path", spec.model.path, spec.model.revision),
                           ("reward.model_path", spec.reward.model_path, spec.reward.model_revision)):
        if not path or path.startswith("builtin:") or os.path.exists(os.path.expanduser(path)) or not is_repo_id(path):
            continue
        commit = cached_commit(path, rev)
        at = f" at revision {rev}" if rev else ""
        where = (f"in the HF cache at commit {commit[:12]} ({hub_cache()})" if commit else
                 f"downloaded when the run starts, into {hub_cache()} (set HF_HOME to move it)"
                 + ("; planned with the model group's shape until then, and again with its config.json"
                    if key == "model.path" else ""))
        out.append(f"  {key} from the Hugging Face Hub{at}: {where}")
    return out

"""The plan: what a run will do, printed before anything starts (no Ray, no torch)."""

from __future__ import annotations

from rlhf.spec.memory import FIT_MARGIN, estimate, param_count, role_memory_gb


def _ranges(devs: tuple[int, ...]) -> str:
    if not devs:
        return "-"
    if list(devs) == list(range(devs[0], devs[-1] + 1)) and len(devs) > 1:
        return f"{devs[0]}-{devs[-1]}"
    return ",".join(str(d) for d in devs)


def _parts(parts: dict[str, float]) -> str:
    return " + ".join(f"{k} {v:.1f}" for k, v in parts.items() if v >= 0.05) or "0"


def warnings(spec, est) -> list[str]:
    out = []
    hw = spec.hardware
    if hw.accelerator == "cuda":
        cap = hw.device_memory_gb * FIT_MARGIN
        if spec.placement.mode == "hybrid":
            for phase, total in (("training", est.train_total), ("generation", est.generate_total)):
                if total > cap:
                    out.append(
                        f"✗ does not fit: the {phase} phase needs ~{total:.0f} GB per GPU, the GPU has "
                        f"{hw.device_memory_gb:.0f} GB. {_fix(spec)}"
                    )
        else:
            for role, gb in role_memory_gb(spec, est).items():
                if gb > cap:
                    out.append(
                        f"✗ does not fit: {role} needs ~{gb:.0f} GB per GPU, the GPU has {hw.device_memory_gb:.0f} GB. "
                        f"{_fix(spec)}"
                    )
    used = set()
    for devs in spec.layout.roles.values():
        used.update(devs)
    idle = spec.layout.total_devices - len(used)
    if idle > 0:
        out.append(f"! {idle} of {spec.layout.total_devices} devices hold no role (idle).")
    if spec.placement.mode == "hybrid" and spec.layout.engines and len(spec.layout.engines) * spec.layout.rollout_tp < spec.layout.total_devices:
        out.append("! some devices run no rollout engine in hybrid placement.")
    return out


def _fix(spec) -> str:
    if spec.train.zero_stage < 3:
        return "Try train.zero_stage=3, model.gradient_checkpointing=true, or more GPUs."
    if not spec.model.gradient_checkpointing:
        return "Try model.gradient_checkpointing=true, train.offload_optimizer=true, or more GPUs."
    if not spec.train.offload_optimizer:
        return "Try train.offload_optimizer=true, a smaller train.micro_batch_size, or more GPUs."
    return "Use more GPUs (hardware=...) or a smaller model."


def render_plan(spec) -> str:
    a, b, hw, lay = spec.algo, spec.batch, spec.hardware, spec.layout
    lines = []
    lines.append(
        f"run: {a.name} · {spec.placement.mode} · {spec.model.name} · {hw.name} "
        f"({hw.nodes} node × {hw.devices_per_node} {'GPU' if hw.accelerator == 'cuda' else 'CPU slot'}"
        + (f", {hw.device_memory_gb:g} GB" if hw.accelerator == "cuda" else "")
        + ")"
    )
    if spec.overrides:
        lines.append("changed from the defaults: " + " ".join(spec.overrides))
    p = param_count(spec.model)
    lines.append(f"model: {spec.model.path} · {p / 1e9:.2f} B parameters · {spec.model.dtype}")
    if a.kind == "rl":
        lines.append(
            f"batch: {b.prompts_per_step} prompts × {b.group_size} samples = {b.samples_per_step} samples/step → "
            f"{b.optimizer_steps_per_step} optimizer step(s) of {b.mini_batch_size} "
            f"(micro {b.micro_batch_size} × {b.grad_accum} accum × {b.train_world_size} ranks)"
        )
        kl = f"KL {a.kl.estimator} × {a.kl.coef:g} in the {a.kl.placement}" if a.kl.coef > 0 else "no KL"
        lines.append(f"algorithm: advantages {a.estimator} · loss {a.loss_agg} · clip [{a.clip_low}, {a.clip_high}] · {kl}")
        lines.append(f"rollout: {spec.rollout_engine} · {spec.rollout.max_prompt_tokens} prompt + "
                     f"{spec.rollout.max_response_tokens} response tokens · temperature {spec.rollout.temperature:g}")
    else:
        lines.append(
            f"batch: {b.prompts_per_step} examples/step (micro {b.micro_batch_size} × {b.grad_accum} accum × "
            f"{b.train_world_size} ranks)"
        )
    lines.append(f"steps: {spec.train.steps} · ZeRO-{spec.train.zero_stage} · seed {spec.train.seed}")

    lines.append(f"placement ({lay.mode}):")
    if lay.mode == "hybrid":
        trained = [r for r in spec.roles if r != "rollout"]
        lines.append(f"  every device holds: {', '.join(trained)}" + (
            f" (ZeRO-{spec.train.zero_stage} shards)" if spec.train.zero_stage == 3 else ""))
    else:
        for role in spec.roles:
            if role != "rollout":
                lines.append(f"  device {_ranges(lay.roles[role])}: {role}")
    shown = list(enumerate(lay.engines))
    if len(shown) > 4:
        shown = shown[:2] + [None] + shown[-1:]
    for item in shown:
        if item is None:
            lines.append(f"  ... {len(lay.engines)} engines in all")
            continue
        i, devs = item
        tp = f" (TP {len(devs)})" if len(devs) > 1 else ""
        lines.append(f"  device {_ranges(devs)}: {spec.rollout_engine} engine {i}{tp}")

    est = estimate(spec)
    if hw.accelerator == "cuda":
        lines.append("memory per GPU (GB, formulas in docs/memory.md):")
        if lay.mode == "hybrid":
            lines.append(f"  training phase:   {_parts(est.train)} = {est.train_total:.1f} of {hw.device_memory_gb:g}")
            if "rollout" in spec.roles:
                lines.append(f"  generation phase: {_parts(est.generate)} = {est.generate_total:.1f} of {hw.device_memory_gb:g}")
        else:
            for role, gb in role_memory_gb(spec, est).items():
                lines.append(f"  {role:<10} {gb:.1f} of {hw.device_memory_gb:g}")
    else:
        lines.append(f"memory: CPU run; training state ~{est.train_total:.2f} GB in host memory")
    warns = warnings(spec, est)
    lines.extend(warns)
    if not any(w.startswith("✗") for w in warns):
        lines.append("✓ fits")
    return "\n".join(lines)

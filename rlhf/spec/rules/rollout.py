"""The rollout section (the engine, by its registered kind, and sampling) and the env section
(multi-turn environments)."""

from __future__ import annotations

from rlhf.rollout import registry as engines
from rlhf.spec.rules import Sections


def problems(s: Sections, roles: tuple[str, ...]) -> list[str]:
    """rollout.*: the engine's rules, then the lengths, the temperature and the engine's memory share."""
    rollout, p = s["rollout"], engine_problems(s)
    if rollout.max_response_tokens < 1 or rollout.max_prompt_tokens < 1:
        p.append("rollout.max_prompt_tokens and rollout.max_response_tokens must be >= 1.")
    if rollout.temperature <= 0 and "rollout" in roles:
        p.append(f"rollout.temperature={rollout.temperature} must be > 0 for RL (sampling is needed).")
    if not 0 < rollout.gpu_memory_utilization < 1:
        p.append(f"rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1).")
    return p


def engine_problems(s: Sections) -> list[str]:
    """rollout.engine: registered (after importing rollout.plugins), runs on this hardware, and its
    kind's own rules."""
    rollout, hw = s["rollout"], s["hardware"]
    p = [msg for msg in map(engines.plugin_problem, rollout.plugins) if msg is not None]
    if p:
        return p
    known = engines.names(rollout.plugins)
    if rollout.engine != "auto" and rollout.engine not in known:
        return [f"rollout.engine={rollout.engine!r} is not valid. Choose one of: auto, {', '.join(known)} "
                "(or register another in a module named in rollout.plugins)."]
    kind = engines.get(engines.resolve(rollout.engine, hw.accelerator, rollout.plugins))
    if hw.accelerator not in kind.accelerators:
        others = [n for n in known if hw.accelerator in engines.get(n).accelerators]
        needs = "GPUs" if kind.accelerators == ("cuda",) else " or ".join(kind.accelerators)
        p.append(f"rollout.engine={kind.name} needs {needs} but hardware={hw.name}. Use "
                 f"rollout.engine={' or '.join(others) or 'auto'} (or auto), or a GPU hardware.")
    if rollout.seeded is False and kind.needs_seeds:
        p.append(f"rollout.seeded=false: the {kind.name} engine draws every sample from its own seeded generator, "
                 "so it needs the seeds. Use rollout.seeded=true (or leave it unset).")
    return p + kind.problems(s)


def env_problems(s: Sections) -> list[str]:
    """env.*: a class named module:Class, turns, and what multi-turn rollouts do not support."""
    en, algo, ev, p = s.get("env"), s["algo"], s.get("eval"), []
    if en is None:
        return p
    if en.fn is not None and ":" not in en.fn:
        p.append(f"env.fn={en.fn!r} must name a class as module:Class or path/to/file.py:Class.")
    if en.max_turns < 1:
        p.append(f"env.max_turns={en.max_turns} must be >= 1.")
    if en.fn is not None and algo.kind != "rl":
        p.append(f"env.fn is for RL runs; algo.kind is {algo.kind!r}: remove env.fn.")
    if en.fn is not None and algo.kind == "rl" and algo.dynamic_sampling:
        p.append("env.fn with algo.dynamic_sampling=true is not supported: set algo.dynamic_sampling=false.")
    if en.fn is not None and ev is not None and ev.every > 0:
        p.append("env.fn with eval.every > 0 is not supported (evaluation is single-turn): set eval.every=0.")
    return p

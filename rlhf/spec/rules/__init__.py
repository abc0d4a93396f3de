"""The validation rules, one module per config section. Each ``problems(s, ...)`` takes the typed
sections (``rlhf.spec.build.typed_config``: a dict of section name → dataclass) and returns one
message per problem, naming the key, the value and a fix; ``rlhf.spec.validate`` runs them in order.

    checks.py     the helpers the rules share (a choice among options, auto/true/false)
    algo.py       algo: the RL parts and their settings, DPO's, the shared optimizer keys
    model.py      model and hardware: dtype, accelerator, LoRA, Liger kernels
    rollout.py    rollout (the engine and its kind's rules, sampling) and env
    placement.py  hardware's device counts and memory, the placement section
    train.py      train: steps, the batch math of one step, the memory settings
    data.py       data and reward
    run.py        tracking, checkpoint, eval and mode
"""

from typing import Any

Sections = dict[str, Any]  # section name → its dataclass, as rlhf.spec.build.typed_config gives them

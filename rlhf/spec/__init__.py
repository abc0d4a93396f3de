"""The run spec: the composed config typed, validated, derived and frozen, once, in the driver.

    build.py     build(cfg) -> RunSpec; config_dict(spec) gives back the user-level config
    schema.py    the dataclasses of every section, registered in Hydra's ConfigStore
    runspec.py   the built spec's types (RunSpec, BatchPlan, Decision)
    validate.py  every check, collected (each message names the key, the value and a fix)
    rules/       the checks, a module per section
    shape.py     the model's architecture numbers from its config.json
    tokens.py    how many tokens one training pass holds
    nodes.py     which node holds which device
    errors.py    SpecError (config), UserError (bad input found at run time); both exit code 2

The devices of every role are ``rlhf.placement`` (the Layout); the plan (memory, disk, advice,
the auto decisions, the --plan text) is ``rlhf.plan``. Nothing here imports torch or Ray.
"""

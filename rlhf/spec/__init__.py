"""The run spec: the composed config typed, validated, derived and frozen, once, in the driver.

    build.py     build(cfg) -> RunSpec; config_dict(spec) gives back the user-level config
    schema.py    the dataclasses of every section, registered in Hydra's ConfigStore
    validate.py  every check, collected (each message names the key, the value and a fix)
    layout.py    the devices of every role (Layout)
    memory.py    per-GPU memory by phase or role (formulas: docs/memory.md)
    plan.py      the --plan text
    errors.py    SpecError (config), UserError (bad input found at run time); both exit code 2

Nothing here imports torch or Ray.
"""

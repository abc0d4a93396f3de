"""The config layer: the config groups composed with Hydra's compose API, overrides parsed and
checked, Hydra's errors as one line, the run dir named, and the composed config built into the
frozen RunSpec. ``rlhf.cli`` (the command line) and ``rlhf.sweep`` (``-m``) both use it; it knows
neither of them, nor the Hydra app (``rlhf.hydra_app``) that runs a job.

    groups.py       GROUPS, group_options, default_choices, register_configs (ConfigStore), group_choices
    overrides.py    parse_overrides, check_group_choices, with_config_dirs (-cd → hydra.searchpath)
    composition.py  compose, hydra_message (a Hydra/OmegaConf error → one line)
    memo.py         compose_kept: Hydra's first stage of a compose kept per process, values applied to a copy
    rundir.py       stamped, unique_dir, run_dir_for, release (a claimed run dir given back)
    build.py        changes_from_defaults, claim_run_dir, build_spec, resume_spec, resume_overrides
    describe.py     describe (rlhf-run --describe KEY: a key's type, value and help text from the schema)
    exits.py        the exit codes
"""

from rlhf.config.build import (build_spec, changes_from_defaults, claim_run_dir, resume_dir, resume_overrides,
                               resume_spec)
from rlhf.config.composition import compose, hydra_message
from rlhf.config.describe import describe
from rlhf.config.exits import EXIT_FAILURE, EXIT_INTERRUPT, EXIT_TERMINATED, EXIT_USER
from rlhf.config.groups import (GROUPS, INTERNAL_GROUPS, default_choices, group_choices, group_options,
                                register_configs)
from rlhf.config.overrides import check_group_choices, parse_overrides
from rlhf.config.rundir import release, run_dir_for, stamped, unique_dir

__all__ = [
    "EXIT_FAILURE", "EXIT_INTERRUPT", "EXIT_TERMINATED", "EXIT_USER", "GROUPS",
    "INTERNAL_GROUPS", "build_spec", "changes_from_defaults", "check_group_choices", "claim_run_dir", "compose",
    "default_choices", "describe", "group_choices", "group_options", "hydra_message", "parse_overrides",
    "register_configs", "release", "resume_dir", "resume_overrides", "resume_spec", "run_dir_for", "stamped",
    "unique_dir",
]

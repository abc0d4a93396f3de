"""`rlhf-run` as a Hydra application: ``hydra.main`` over the shipped config groups.

Hydra owns its command line: ``--cfg job|hydra|all`` (``--resolve``, ``--package``), ``--info``,
``--shell-completion``, ``--hydra-help``, ``-m`` with its sweeper and launcher plugins, and the
``hydra.run.dir`` / ``hydra.sweep.dir`` / ``hydra.job.chdir`` settings. ``rlhf.cli`` checks the
command line first (one-line errors, exit 2) and then hands it to ``run_app`` with a task function.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

# Hydra's flags: the ones that take a value, and the ones that do not. ``--info`` takes an optional one.
HYDRA_VALUE_FLAGS = {"-c": "--cfg", "--cfg": "--cfg", "-p": "--package", "--package": "--package",
                     "--experimental-rerun": "--experimental-rerun"}
HYDRA_BARE_FLAGS = {"--resolve": "--resolve", "-sc": "--shell-completion", "--shell-completion": "--shell-completion",
                    "--hydra-help": "--hydra-help", "--version": "--version", "-r": "--run", "--run": "--run"}
INFO_FLAGS = ("-i", "--info")
INFO_TOPICS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
CFG_KINDS = ("job", "hydra", "all")

HYDRA_HELP = """\
Hydra options (rlhf-run is a Hydra app; https://hydra.cc/docs/advanced/hydra-command-line-flags):
  --cfg, -c job|hydra|all   print the composed config (job: what the run uses) and exit
  --resolve                 with --cfg: resolve interpolations (${now:...}, ${hydra:...})
  --package, -p PKG         with --cfg: only this part, e.g. -p algo
  --info, -i [all|config|defaults|defaults-tree|plugins|searchpath]
                            how the config was composed, and the installed plugins
  --shell-completion, -sc   tab completion: eval "$(rlhf-run -sc install=bash)"
  --hydra-help              Hydra's own help
  hydra.run.dir=DIR         the run dir pattern (default outputs/${now:%Y-%m-%d}/${now:%H-%M-%S})
  hydra.sweep.dir=DIR       the sweep dir of -m (default multirun/<date>/<time>; job n in DIR/n)
  hydra.job.chdir=true      run the job inside its run dir
  hydra/sweeper=optuna      -m searches hydra.sweeper.params with Optuna (recipe=grpo_tiny_optuna)
  hydra/launcher=submitit_slurm  -m sends each job to SLURM (pip install 'rlhf[slurm]')
  hydra/launcher=parallel   -m runs the jobs that fit side by side on the Ray cluster at once
"""


def run_app(task: Callable[[Any], Any], argv: Sequence[str], config_dir: Optional[str] = None,
            config_name: str = "config") -> int:
    """Run ``task`` as the task function of a ``hydra.main`` app with Hydra's command line
    ``argv``; returns Hydra's exit code (0 unless Hydra itself stopped, having printed why).

    ``hydra.main`` reads its command line from ``sys.argv`` only, so it is set for the call:
    ``rlhf-run``'s own flags (``--plan``) and checks come off first.
    """
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    from rlhf.config.groups import register_configs
    from rlhf.paths import conf_dir

    register_configs()
    GlobalHydra.instance().clear()
    path = str(Path(config_dir).expanduser().resolve()) if config_dir else str(conf_dir())
    app = hydra.main(config_path=path, config_name=config_name, version_base="1.3")(task)
    saved = sys.argv
    sys.argv = [saved[0] if saved else "rlhf-run", *argv]
    # --info sets the root logger to DEBUG with a handler on sys.stdout and leaves it: undone after,
    # for a caller that goes on in this process (the tests, a sweep's driver)
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        app()
        return 0
    except SystemExit as e:  # hydra.main exits on its own errors (printed) and after --help-like flags
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()
        root.setLevel(level)
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)


def hydra_overrides(config_dir: Optional[str]) -> list[str]:
    """The Hydra settings every run gets: the job's name, no ``.hydra/`` in the run dir (the run
    writes its own config.yaml once it holds the dir's lock), and (for a saved config, which has no
    defaults list of its own) the logging choice of conf/config.yaml."""
    out = ["hydra.job.name=rlhf", "hydra.output_subdir=null"]
    if config_dir is not None:
        out += ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    return out


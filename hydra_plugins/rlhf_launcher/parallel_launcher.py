"""The ``hydra/launcher=parallel`` plugin (Hydra takes plugins only from the hydra_plugins package);
the work is in rlhf/sweep_parallel.py. Its config is stored by rlhf.config.register_configs."""

from __future__ import annotations

from typing import Any, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher


class ParallelLauncher(Launcher):
    """Runs the jobs of an ``rlhf-run -m`` sweep that fit side by side on the Ray cluster at once."""

    def __init__(self) -> None:
        super().__init__()
        self.config: Any = None
        self.task_function: Any = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from rlhf.sweep_parallel import launch

        return launch(self.hydra_context, self.task_function, self.config, job_overrides, initial_job_idx)

"""The process exit codes of ``rlhf-run``, in one place: the CLI, a sweep and a run return these."""

EXIT_FAILURE = 1  # a failed run (a worker process died) or a failed sweep job
EXIT_USER = 2  # bad input: a config error before the run, or bad data/paths found while it runs
EXIT_INTERRUPT = 130  # Ctrl-C (SIGINT): 128 + 2
EXIT_TERMINATED = 143  # SIGTERM (a scheduler's preemption, kill <pid>): 128 + 15

"""`rlhf-run`: compose the config groups, build the spec, then plan or run.

    rlhf-run                                   # GRPO on the built-in task, CPU
    rlhf-run algo=ppo model=llama3-8b hardware=8xh100 --plan
    rlhf-run -m algo.lr=1e-3,3e-3              # a sweep (Hydra multirun, see rlhf/sweep.py)
    rlhf-run -cp outputs/2026-11-29/12-00-00 -cn config    # rerun a run's saved config
    rlhf-run resume=outputs/2026-11-29/12-00-00            # continue it from its newest checkpoint

    rlhf-run --cfg job algo=ppo                            # Hydra's flags: --cfg, --info, -sc, ...
    rlhf-run --describe algo.kl.coef algo=ppo              # a key's type, value and meaning

rlhf-run is a Hydra app (rlhf/hydra_app.py). This module parses the command line, prints and
dispatches; the config layer (rlhf/config) composes the config with Hydra's compose API, so every
config error becomes one readable line and exit code 2 before anything starts (HYDRA_FULL_ERROR=1
shows the traceback instead), and builds the frozen RunSpec once, here in the driver; then
``hydra.main`` runs the job in its run dir (``rlhf.run.execute``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhf.config import (EXIT_USER, GROUPS, build_spec, claim_run_dir, compose, default_choices, describe,
                         group_options, release, resume_dir, resume_overrides, resume_spec)
from rlhf.config import register_configs, run_dir_for  # noqa: F401 - scripts and tests import them from here
from rlhf.config.groups import option_problem
from rlhf.config.overrides import user_dirs, with_config_dirs
from rlhf.config.rundir import Claimed
from rlhf.quoting import quote_value
from rlhf.run import check_before_run, execute
from rlhf.spec.runspec import RunSpec

# ----------------------------------------------------------------------------- help


HELP = """\
rlhf-run — RLHF training from composable config groups.

usage: rlhf-run [GROUP=OPTION ...] [KEY=VALUE ...] [--plan] [-m] [-cp DIR -cn NAME] [HYDRA FLAGS]

  --plan         print what differs from the defaults, the batch math, the placement map and the
                 memory per GPU, then exit (no Ray, no GPU; about a second)
  -m, --multirun sweep comma-separated values, one job each: rlhf-run -m algo.lr=1e-6,5e-7
                 (or search with Hydra's Optuna sweeper: rlhf-run -m recipe=grpo_tiny_optuna)
  -cd DIR, --config-dir DIR
                 add your own folder of recipes and group options to the search path (Hydra's
                 --config-dir; repeatable): DIR/recipe/mine.yaml is recipe=mine, DIR/algo/x.yaml is
                 algo=x; a recipe of a shipped name replaces the shipped one. The same:
                 hydra.searchpath=[file://DIR], or $RLHF_CONFIG_DIRS (folders joined by ':')
  -cp DIR -cn NAME
                 take the primary config from DIR/NAME.yaml; a run dir reruns its saved config:
                 rlhf-run -cp outputs/2026-11-29/12-00-00 -cn config
  resume=DIR     continue the run in DIR from its newest checkpoint (its config.yaml + any
                 overrides); a run whose output_dir already holds a checkpoint continues by itself
  --describe KEY print KEY's type, its value in this composition (groups and other overrides
                 honoured) and what it does; a section (--describe algo) prints every key under it
  -h, --help     this text
  HYDRA_FULL_ERROR=1  show tracebacks instead of one-line errors

config groups (the default first):
{groups}

keys: any KEY=VALUE of the spec, e.g. algo.lr=1e-6 algo.kl.coef=0.05 train.steps=200
      placement.rollout.tensor_parallel=2 rollout.max_response_tokens=512 output_dir=runs/x
      (each key's meaning: rlhf-run --describe KEY, or rlhf/spec/schema.py; a group's own file:
      conf/<group>/<option>.yaml)

examples:
  rlhf-run                                           # GRPO on the built-in task, on CPU
  rlhf-run algo=grpo placement=hybrid model=llama3-8b hardware=8xh100 --plan
  rlhf-run algo=ppo algo.kl.coef=0.05 train.steps=200
  rlhf-run recipe=grpo_tiny                          # a checked-in experiment from recipes/
  rlhf-run algo=ppo --describe algo.kl               # what the KL keys do, and PPO's values
"""


def render_help(dirs: Sequence[Path] = ()) -> str:
    """The help text; ``dirs``: the user's config folders, whose options are listed too. An option
    whose file is not valid YAML is marked [broken], its problem named below the groups."""
    defaults = default_choices()
    lines, broken = [], []
    for g in GROUPS:
        opts = group_options(g, dirs)
        default = defaults.get(g)
        ordered = ([default] if default in opts else []) + [o for o in opts if o != default]
        problems = {o: option_problem(g, o, dirs) for o in ordered}
        broken += [f"  {p}" for p in problems.values() if p]
        ordered = [f"{o} [broken]" if problems[o] else o for o in ordered]
        if g == "recipe":
            ordered = ["(none)"] + ordered
        lines.append(f"  {g:<10} {', '.join(ordered) if ordered else '(none)'}")
    if broken:
        lines += ["", "broken (each fails only when picked):", *broken]
    from rlhf.hydra_app import HYDRA_HELP

    return HELP.format(groups="\n".join(lines)) + "\n" + HYDRA_HELP


def help_dirs(argv: Sequence[str]) -> list[Path]:
    """The user's config folders that a ``--help`` command line names (-cd, hydra.searchpath,
    $RLHF_CONFIG_DIRS); none if the rest of the line does not parse."""
    from rlhf.spec.errors import SpecError

    try:
        args = parse_args([a for a in argv if a not in ("-h", "--help")])
        return user_dirs(with_config_dirs(args.overrides, args.config_dirs))
    except SpecError:
        return []


# ----------------------------------------------------------------------------- arguments


@dataclass
class Args:
    overrides: list[str] = field(default_factory=list)
    plan: bool = False
    multirun: bool = False
    config_dir: Optional[str] = None  # -cp: the primary config's folder (a run dir's saved config)
    config_name: str = "config"
    config_dirs: list[str] = field(default_factory=list)  # -cd: the user's folders added to the search path
    hydra_flags: list[str] = field(default_factory=list)  # Hydra's own (--cfg, --info, -sc, ...), passed on
    describe: Optional[str] = None  # --describe KEY: print the key's type, value and help, then exit

    @property
    def hydra_only(self) -> bool:
        """Hydra prints something and exits (--cfg, --info, --shell-completion, --hydra-help, --version)."""
        return any(f in ("--cfg", "--info", "--shell-completion", "--hydra-help", "--version") for f in self.hydra_flags)


FLAGS_WITH_VALUE = {
    "-cp": "config_dir", "--config-path": "config_dir", "-cd": "config_dirs", "--config-dir": "config_dirs",
    "-cn": "config_name", "--config-name": "config_name",
}


def _set_flag(args: Args, flag: str, value: str) -> None:
    name = FLAGS_WITH_VALUE[flag]
    if name == "config_dirs":
        args.config_dirs.append(value)
    else:
        setattr(args, name, value)


def parse_args(argv: Sequence[str]) -> Args:
    """Flags and overrides from the command line (raises SpecError for an unknown flag)."""
    from rlhf.hydra_app import CFG_KINDS, HYDRA_BARE_FLAGS, HYDRA_VALUE_FLAGS, INFO_FLAGS, INFO_TOPICS
    from rlhf.spec.errors import SpecError

    args = Args()
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if a == "--plan":
            args.plan = True
        elif a in ("-m", "--multirun"):
            args.multirun = True
        elif a == "--describe" or a.startswith("--describe="):
            if "=" in a:
                value = a.split("=", 1)[1]
            else:
                value = argv[i] if i < len(argv) else ""
                i += 1
            if not value or value.startswith("-") or "=" in value:
                raise SpecError(["--describe needs a key, e.g. --describe algo.kl.coef "
                                 "(or a section: --describe algo)."])
            args.describe = value
        elif a in FLAGS_WITH_VALUE or a in HYDRA_VALUE_FLAGS:
            value = argv[i] if i < len(argv) else None
            i += 1
            if value is None:
                example = "job" if a in ("-c", "--cfg") else "algo" if a in ("-p", "--package") else (
                    "outputs/<run dir>" if "p" in a or "d" in a else "config")
                raise SpecError([f"{a} needs a value, e.g. {a} {example}."])
            if a in ("-c", "--cfg") and value not in CFG_KINDS:
                raise SpecError([f"{a} {value}: choose one of {', '.join(CFG_KINDS)} (job: the config a run uses)."])
            if a in FLAGS_WITH_VALUE:
                _set_flag(args, a, value)
            else:
                args.hydra_flags += [HYDRA_VALUE_FLAGS[a], value]
        elif a.split("=", 1)[0] in FLAGS_WITH_VALUE and "=" in a:
            k, v = a.split("=", 1)
            _set_flag(args, k, v)
        elif a in HYDRA_BARE_FLAGS:
            args.hydra_flags.append(HYDRA_BARE_FLAGS[a])
        elif a in INFO_FLAGS:
            args.hydra_flags.append("--info")
            if i < len(argv) and argv[i] in INFO_TOPICS:
                args.hydra_flags.append(argv[i])
                i += 1
        elif a.startswith("-") and not a.startswith("~"):
            raise SpecError([
                f"unknown option {a!r}. Options: --plan, -m/--multirun, -cd DIR, -cp DIR, -cn NAME, --describe KEY, "
                "--help; Hydra's "
                "--cfg job|hydra|all, --info, --shell-completion (rlhf-run --help); "
                "everything else is GROUP=OPTION or KEY=VALUE."
            ])
        else:
            args.overrides.append(a)
    _check_hydra_flags(args)
    return args


def _check_hydra_flags(args: Args) -> None:
    """Hydra's flags that only mean something in one mode are refused outside it (SpecError), not
    dropped: a run or a sweep hands Hydra the overrides only."""
    from rlhf.spec.errors import SpecError

    flags = args.hydra_flags
    problems = []
    if "--experimental-rerun" in flags:
        problems.append("--experimental-rerun: rlhf-run builds every run from its config, not from Hydra's pickled "
                        "job; rerun a run's saved config with rlhf-run -cp <run dir> -cn config.")
    if "--cfg" not in flags:
        for flag, what in (("--resolve", "interpolations resolved"), ("--package/-p", "only that part, e.g. -p algo")):
            if flag.split("/")[0] in flags:
                problems.append(f"{flag} works only with --cfg job|hydra|all (print the composed config, {what}).")
    if "--run" in flags:
        other = next((f for f in ("--cfg", "--info", "--shell-completion") if f in flags),
                     "-m/--multirun" if args.multirun else None)
        if other:
            problems.append(f"-r/--run (a single run, the default) does not go with {other}: drop -r.")
        flags.remove("--run")  # a single run is what rlhf-run does without it
    if problems:
        raise SpecError(problems)




def main(argv: Optional[Sequence[str]] = None) -> int:
    """``rlhf-run``: the exit code (0 ok, 2 a config or input error, 1 a failed run or sweep job)."""
    from rlhf.spec.errors import SpecError

    argv = list(sys.argv[1:] if argv is None else argv)
    from rlhf.paths import record_tracking_dir

    record_tracking_dir()  # the project's MLflow store: outputs/ here, wherever Hydra moves the run
    if "--help" in argv or "-h" in argv:
        print(render_help(help_dirs(argv)))
        return 0
    try:
        args = parse_args(argv)
        if resume_dir(args.overrides) is None:  # a resumed run's saved config needs no search path
            args.overrides = with_config_dirs(args.overrides, args.config_dirs)
        if args.describe is not None:
            cfg = compose(args.overrides, config_dir=args.config_dir, config_name=args.config_name)
            print(describe(cfg, args.describe))
            return 0
        if args.hydra_only:
            return hydra_only(args)
        if args.multirun:
            from rlhf.sweep import multirun_main

            return multirun_main(args)
        resume = resume_dir(args.overrides)
        if resume is not None:
            overrides = [o for o in args.overrides if o.split("=", 1)[0] != "resume"]
            spec = resume_spec(resume, overrides, args.plan)
            if spec.mode == "plan":
                return execute(spec)
            folder = Path(resume).expanduser().resolve()
            return run_in_hydra(spec, [*overrides, *resume_overrides(folder)], config_dir=str(folder))
        cfg = compose(args.overrides, config_dir=args.config_dir, config_name=args.config_name)
        claimed = None if args.plan else claim_run_dir(cfg, args.config_dir)
        try:
            spec = build_spec(cfg, args.overrides, args.plan, config_dir=args.config_dir)
        except BaseException:
            release(claimed)
            raise
    except SpecError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(e.render(), file=sys.stderr)
        return EXIT_USER
    if spec.mode == "plan":
        return execute(spec)
    return run_in_hydra(spec, args.overrides, config_dir=args.config_dir, config_name=args.config_name,
                        claimed=claimed)


def hydra_only(args: Args) -> int:
    """--cfg, --info, --shell-completion, --hydra-help, --version: Hydra prints, nothing runs. The
    config is composed first, so that a config error is still one line and exit code 2."""
    from rlhf.hydra_app import hydra_overrides, run_app

    composes = any(f in ("--cfg", "--info") for f in args.hydra_flags)
    if composes and not args.multirun:
        compose(args.overrides, config_dir=args.config_dir, config_name=args.config_name)
    # Hydra's flags last: --info takes an optional topic, and would read an override after it as one
    argv = [*hydra_overrides(args.config_dir), *args.overrides, *(["--multirun"] if args.multirun else []),
            *args.hydra_flags]
    return run_app(lambda cfg: None, argv, config_dir=args.config_dir, config_name=args.config_name)


def run_in_hydra(spec: RunSpec, overrides: Sequence[str], config_dir: Optional[str] = None,
                 config_name: str = "config", claimed: Optional[Claimed] = None) -> int:
    """Run a built spec as the job of the Hydra app: Hydra makes its run dir the spec's output_dir
    (``.hydra/`` inside, ``hydra.job.chdir`` honoured), then the task executes the spec. The spec was
    built from the same config before Hydra started, so a config error never starts a job.
    ``claimed``: the run dir made for this run, given back if the checks refuse it."""
    from rlhf.hydra_app import hydra_overrides, run_app

    code = check_before_run(spec)  # before Hydra makes the run dir
    if code:
        release(claimed)
        return code
    codes: list[int] = []
    raised: list[BaseException] = []

    def task(cfg: Any) -> None:
        try:
            codes.append(execute(spec, checked=True))
        except BaseException as e:  # noqa: BLE001 - raised again outside Hydra, which would print it as its own
            raised.append(e)

    argv = [*hydra_overrides(config_dir), *overrides, f"hydra.run.dir={quote_value(str(spec.output_dir))}"]
    code = run_app(task, argv, config_dir=config_dir, config_name=config_name)
    result = codes[0] if codes else (code or 1)
    if raised or result:  # a run refused in its preflight emptied its run dir: the dirs made for it go too
        release(claimed)
    if raised:
        raise raised[0]
    return result


def entrypoint() -> None:
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # rlhf-run --plan | head
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    entrypoint()

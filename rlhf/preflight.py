"""Checks of a run's inputs in the driver, BEFORE Ray starts: a bad data file, reward function,
model path or output dir is one ``UserError`` line (exit code 2) and no half-started cluster.

    check_output_dir(path)            writable (created if missing)
    check_disk(spec)                  the checkpoints and final export fit the disk under output_dir
    check_cpu_threads()               RLHF_CPU_THREADS, when set, is a positive whole number
    resolve_models(spec)              model.path / reward.model_path -> local checkpoint dirs with
                                      weights (a Hub id fetched into the HF cache), kept in the
                                      spec (``RunSpec.models``) for the workers
    check_model(spec)                 model path is a checkpoint; its tokenizer has a pad token
                                      (or an EOS to use as one) and a chat template where needed
    check_prompts(spec, tokenizer)    RL prompt files: readable, every row has a text prompt,
                                      ids unique, not every prompt over rollout.max_prompt_tokens
    check_rewards(spec)               every reward function imports (the file or module named,
                                      nothing else)
    check_checkpoint(spec)            the checkpoint a resume starts from passes its manifest
                                      (a corrupt newer one named and set aside); an RL run whose
                                      run dir already finished every step stops (``Finished``)

``preflight(spec)`` runs all that apply to the run's kind; ``rlhf.run.run`` calls it after
``resolve_models``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Optional

from rlhf.spec.errors import UserError
from rlhf.spec.runspec import RunSpec
from rlhf.track.tracker import Console

ID_KEYS = ("id", "uid", "prompt_id")


class Finished(Exception):
    """The run dir holds a finished run of this spec: nothing to do (exit code 0, one line)."""


def check_checkpoint(spec: RunSpec, console: Optional[Console] = None) -> RunSpec:
    """The checkpoint this run resumes from, verified against its manifest before Ray starts
    (``rlhf.ckpt.manager.resume_point``): a corrupt newest one is named in one line, set aside, and
    the newest intact one taken (saying so); none intact, or a corrupt one named by ``resume=``, is
    a UserError. Returns the spec with ``resume`` set to the chosen checkpoint dir (what the loops
    load), or as it was when there is none. Raises ``Finished`` for an RL run whose newest
    checkpoint is its last step and whose final export is there: nothing would run."""
    import dataclasses

    from rlhf.ckpt.manager import resume_point
    from rlhf.spec.build import freeze

    try:
        point = resume_point(spec.resume or spec.run_dir)
    except ValueError as e:
        raise UserError(str(e)) from None
    chosen = point.chosen
    for where, why in point.corrupt:
        name = where.name.rsplit(".", 1)[0]
        then = (f"resuming from {chosen.path.name}, the newest intact one" if chosen is not None
                else "starting afresh")
        line = f"warning: checkpoint {name} is corrupt ({why}): set aside as {where}; {then}"
        console.print(line) if console is not None else print(line)
    if chosen is None:
        return spec
    final = Path(spec.run_dir) / "final" / "hf"
    if spec.algo.kind == "rl" and chosen.step >= spec.train.steps and final.is_dir():
        from rlhf.quoting import resume_command

        raise Finished(f"{spec.run_dir} has finished all {spec.train.steps} steps (checkpoint "
                       f"{chosen.path.name}, {final}): nothing to run. More steps: "
                       f"{resume_command(spec.run_dir)} train.steps=<more>; a new run: another output_dir.")
    return freeze(dataclasses.replace(spec, resume=str(chosen.path)))


def not_writable(what: str, e: OSError) -> str:
    """The line for a run dir that cannot be made or written (``what``: the key and value)."""
    return (f"{what} is not writable ({e.strerror or type(e).__name__}). "
            "Give a directory you can write to: output_dir=<path>.")


def check_cpu_threads() -> None:
    """RLHF_CPU_THREADS, which the workers read for their CPU threads (rlhf.workers.base), is a
    positive whole number when set: a bad one stops here, not as a traceback in every worker."""
    value = os.environ.get("RLHF_CPU_THREADS")
    if value and not (value.strip().isdigit() and int(value) > 0):
        raise UserError(f"RLHF_CPU_THREADS={value!r}: give a positive whole number of CPU threads per "
                        "worker process, or unset it (each worker then takes its share of the node).")


def check_output_dir(path: str) -> None:
    """``path`` is a directory this process can write to (created if missing), else UserError."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(not_writable(f"output_dir={path}", e)) from None
    if not p.is_dir():
        raise UserError(f"output_dir={path} is not a directory. Give a directory: output_dir=<path>.")


def resolve_models(spec: RunSpec, console: Optional[Console] = None) -> RunSpec:
    """Find model.path (and reward.model_path) once, in the driver: a local dir (checked for
    config.json and weights), builtin:<name> (built once), or a Hub id: the HF cache, else a download
    (``model.revision``; HF_HUB_OFFLINE=1: the cache only). Returns the spec with the results
    (``RunSpec.models``), so that every worker loads the same snapshot."""
    from rlhf.models.load import resolve_model
    from rlhf.spec.build import with_models

    say = console.print if console is not None else None
    found = {"model": resolve_model(spec.model.path, spec.model, revision=spec.model.revision,
                                    what="model.path", say=say)}
    if spec.reward.model_path:
        found["reward"] = resolve_model(spec.reward.model_path, spec.model, revision=spec.reward.model_revision,
                                        what="reward.model_path", say=say)
    if spec.algo.kind == "rl" and spec.algo.teacher.path:  # on-policy distillation's teacher
        from rlhf.spec.shape import teacher_model

        found["teacher"] = resolve_model(spec.algo.teacher.path, teacher_model(spec.model, spec.algo.teacher),
                                         revision=spec.algo.teacher.revision, what="algo.teacher.path", say=say)
    for role, m in found.items():
        if m.repo and console is not None:
            key = {"model": "model.path", "teacher": "algo.teacher.path"}.get(role, "reward.model_path")
            console.print(f"{key}: {m.repo} at commit {m.commit[:12]} ({m.path})")
    if found["model"].repo and _shape_differs(spec, found["model"].path):
        # a Hub model fetched just now: the spec was planned with the model group's numbers, so
        # build it again (the build reads the cached config.json now) and check that it fits
        from rlhf.spec.build import build, config_dict
        from rlhf.spec.errors import SpecError

        try:
            spec = build(config_dict(spec), overrides=spec.overrides, changes=spec.changes)
        except SpecError as e:  # the checkpoint's numbers break a setting the model group's passed
            raise UserError(" ".join(e.problems)) from None
        if console is not None:
            from rlhf.spec.shape import shape_line

            console.print("planned again with the checkpoint's numbers:" + (shape_line(spec) or "")[1:])
        check_fits(spec)  # the plan checked before the run was the group's
        check_disk(spec)
    return with_models(spec, found)


def _shape_differs(spec: RunSpec, path: str) -> bool:
    from rlhf.spec.shape import checkpoint_shape, shape_of

    shape = checkpoint_shape(Path(path) / "config.json")
    return shape is not None and shape != shape_of(spec.model)


def check_model(spec: RunSpec, needs_chat_template: bool = False):
    """Resolve the model path and load its tokenizer (builds builtin:tiny once). Returns the tokenizer."""
    from rlhf.models import load_tokenizer, model_dir

    path = model_dir(spec)
    tok = load_tokenizer(path)
    if tok.pad_token is None:
        raise UserError(
            f"the tokenizer of model.path={spec.model.path} has neither a pad token nor an EOS token to pad with. "
            "Add one to the checkpoint (tokenizer.add_special_tokens({'pad_token': ...}); save_pretrained)."
        )
    from rlhf.spec.shape import read_config

    config = read_config(Path(path) / "config.json") or {}
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and len(tok) > vocab:  # its ids from vocab up have no embedding row
        raise UserError(
            f"the tokenizer of model.path={spec.model.path} has {len(tok)} tokens but the model's vocab_size is "
            f"{vocab}: token ids from {vocab} up would index past its embedding. Use the tokenizer saved with this "
            "model (its tokenizer files beside config.json), or resize the model's embeddings to the tokenizer."
        )
    if needs_chat_template and not getattr(tok, "chat_template", None):
        raise UserError(
            f"data.chat_template=true (or chat-message prompts) but the tokenizer of model.path={spec.model.path} "
            "has no chat template. Set data.chat_template=false, or use a checkpoint whose "
            "tokenizer_config.json has a chat_template."
        )
    return tok


def needs_chat_template(spec: RunSpec, rows: Optional[list] = None) -> bool:
    if spec.data.chat_template or spec.agent.enabled:  # agent rollouts render every prompt as a chat
        return True
    key = spec.data.prompt_key
    return bool(rows) and any(isinstance(r.get(key), list) for r in rows)


def _where(name: str, i: int) -> str:
    return f"data file {name}, row {i}"


def check_prompt_rows(name: str, rows: list[dict], prompt_key: str) -> None:
    """Every row has a non-empty text prompt (or chat messages); ids (if any) are unique."""
    from rlhf.data.files import check_messages

    seen: dict[Any, int] = {}
    id_key = next((k for k in ID_KEYS if rows and k in rows[0]), None)
    for i, row in enumerate(rows):
        v = row.get(prompt_key)
        if v is None:
            keys = ", ".join(k for k, x in row.items() if x is not None) or "none"
            raise UserError(
                f"{_where(name, i)}: no {prompt_key!r} (keys: {keys}). Add it to every row, or set "
                "data.prompt_key=<the key that holds the prompt>."
            )
        if isinstance(v, list):
            check_messages(v, where=f"{_where(name, i)}: {prompt_key!r}")
        elif not isinstance(v, str):
            raise UserError(
                f"{_where(name, i)}: {prompt_key!r} should be a string (or a list of chat messages), got "
                f"{type(v).__name__} ({str(v)[:40]}). Fix the row, or point data.prompt_key at the text."
            )
        elif not v.strip():
            raise UserError(f"{_where(name, i)}: {prompt_key!r} is empty. Remove the row or give it a prompt.")
        if id_key is not None and row.get(id_key) is not None:
            rid = row[id_key]
            if rid in seen:
                raise UserError(
                    f"{_where(name, i)}: duplicate {id_key} {rid!r} (also row {seen[rid]}). "
                    f"Give every row its own {id_key}, or remove the repeated row."
                )
            seen[rid] = i


def prompt_lengths(spec: RunSpec, tokenizer, rows: list[dict]) -> list[int]:
    from rlhf.data.prompts import render_prompt

    # one batched call per kind of row (a fast tokenizer encodes a list at once, not row by row)
    out = [0] * len(rows)
    groups: dict[bool, tuple[list[int], list[str]]] = {}
    for i, row in enumerate(rows):
        templated = spec.data.chat_template or isinstance(row[spec.data.prompt_key], list)
        at, texts = groups.setdefault(templated, ([], []))
        at.append(i)
        texts.append(render_prompt(row, spec.data, tokenizer))
    for templated, (at, texts) in groups.items():
        for i, ids in zip(at, tokenizer(texts, add_special_tokens=not templated)["input_ids"]):
            out[i] = len(ids)
    return out


def long_prompt_filter(spec: RunSpec, tokenizer):
    """A ``keep(row)`` predicate: the prompt fits rollout.max_prompt_tokens."""
    limit = spec.rollout.max_prompt_tokens

    def keep(row: dict) -> bool:
        return prompt_lengths(spec, tokenizer, [row])[0] <= limit

    return keep


def check_prompts(spec: RunSpec, tokenizer) -> dict[str, int]:
    """Read every RL train file and check its rows; {file: prompts over the length limit}.

    Raises UserError when a file cannot be read, a row is bad, or every prompt is over the limit."""
    from rlhf.data.prompts import read_rows

    limit = spec.rollout.max_prompt_tokens
    over: dict[str, int] = {}
    total = kept = 0
    for name in spec.data.train_files:
        rows = read_rows(name, spec.data.prompt_key, spec.data.columns)
        check_prompt_rows(name, rows, spec.data.prompt_key)
        n_over = sum(1 for n in prompt_lengths(spec, tokenizer, rows) if n > limit)
        over[name] = n_over
        total += len(rows)
        kept += len(rows) - n_over
    if total and kept == 0:
        raise UserError(
            f"all {total} prompts of data.train_files are longer than rollout.max_prompt_tokens={limit} tokens. "
            "Raise rollout.max_prompt_tokens, or give shorter prompts."
        )
    return over


# Responses the reward functions are called on before the run: what a policy may well produce.
STAND_IN_RESPONSES = ("", "I think the answer is 42.", "x" * 300)


def check_rewards(spec: RunSpec, rows: Optional[list] = None) -> None:
    """Import every reward function now (where the run calls it: its own process by default), and
    call them (not the remote service) on a few stand-in samples: the first prompts of ``rows``
    (the train file's; their other columns as metadata) with responses of STAND_IN_RESPONSES. A typo, an import error, an exception, a wrong number
    of values, NaN or a function slower than reward.timeout_s costs a second here, not a cluster
    start (UserError, one line)."""
    from rlhf.rewards.loader import Rewards

    env = getattr(spec, "env", None)
    if env is not None and getattr(env, "fn", None):  # a multi-turn environment class: same loader
        from rlhf.envs import load_env

        load_env(env.fn)
    if not spec.reward.functions:
        return
    key = spec.data.prompt_key
    rows = list(rows or [])[:2] or [{key: "a stand-in prompt"}]
    pairs = [(row, r) for row in rows for r in STAND_IN_RESPONSES]
    prompts = [str(row.get(key, "")) for row, _ in pairs]
    responses = [r for _, r in pairs]
    metadata = {k: [row.get(k) for row, _ in pairs] for k in rows[0] if k != key}
    metadata["finish_reasons"] = ["stop" if i % 2 == 0 else "length" for i in range(len(pairs))]
    rewards = Rewards(spec.reward, remote=False)  # imported where they run (a process: reward.isolate)
    try:
        rewards.score(prompts, responses, metadata)
    except UserError as e:
        raise UserError(f"{str(e).rstrip('.')}. Found before the run started, on {len(pairs)} stand-in samples "
                        "(prompts of data.train_files, responses such as '' and 'I think the answer is 42.').") from None
    finally:
        rewards.close()


def check_fits(spec: RunSpec) -> None:
    """A GPU run whose plan says it does not fit stops here, before anything starts: the plan is
    a promise both ways (what it calls fitting must run, and what it rejects never starts). Off
    CUDA every run fits (``memory.over_limit``)."""
    from rlhf.plan.memory import estimate
    from rlhf.plan.memory import fits
    from rlhf.plan.render import warnings

    est = estimate(spec)
    if fits(spec, est):
        return
    first = next((w for w in warnings(spec, est) if w.startswith("✗")), "✗ does not fit")
    raise UserError(first[2:] + " (rlhf-run <same overrides> --plan shows every figure)")


def check_disk(spec: RunSpec) -> None:
    """A run whose checkpoints and final export need more than the disk under its output_dir has
    free (``rlhf.plan.disk``; the plan prints the same line) stops here, before anything starts:
    on CPU too, where the tiny runs need kilobytes."""
    from rlhf.plan import disk
    from rlhf.plan.render import disk_warning

    line = disk_warning(spec, disk.need(spec), disk.available_bytes(spec))
    if line is not None:
        raise UserError(line[2:] + " (rlhf-run <same overrides> --plan shows every figure)")


def preflight(spec: RunSpec, console: Optional[Console] = None) -> Any:
    """Everything that can be checked in the driver before the cluster starts (UserError).

    For sft/rm/dpo that is reading and tokenising the data sets: the result (``prepare`` of the
    kind's loop) is returned for ``rlhf.run.run`` to hand to the loop; None for RL. The fit and the
    output dir were checked before (``rlhf.run.check_before_run``, ``resolve_models``)."""
    if spec.algo.kind == "rl":
        from rlhf.data.prompts import read_rows

        first = read_rows(spec.data.train_files[0], spec.data.prompt_key, spec.data.columns) \
            if spec.data.train_files else []
        tok = check_model(spec, needs_chat_template(spec, first))
        over = check_prompts(spec, tok)
        if spec.eval.every > 0:  # eval prompts: readable, the prompt column, every row (rlhf.loops.rl_eval)
            for name in spec.data.eval_files:
                check_prompt_rows(name, read_rows(name, spec.data.prompt_key, spec.data.columns), spec.data.prompt_key)
        check_rewards(spec, first)
        n = sum(over.values())
        if n and console is not None:
            console.print(f"data: {n} prompts longer than rollout.max_prompt_tokens={spec.rollout.max_prompt_tokens} "
                          "will be dropped (" + ", ".join(f"{k}: {v}" for k, v in over.items() if v) + ")")
    else:
        check_model(spec)
        import importlib

        return importlib.import_module(f"rlhf.loops.{spec.algo.kind}").prepare(spec, console)
    return None

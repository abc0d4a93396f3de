"""What every tracker records of a run: its params (the flattened config, secrets redacted) and,
for a sweep job, which sweep it belongs to."""

from __future__ import annotations

import contextvars
from typing import Any, Optional

from rlhf.spec.runspec import RunSpec

SECRET_WORDS = ("token", "secret", "password", "passwd", "api_key", "apikey", "credential", "private_key",
                "authorization", "auth_header")
REDACTED = "***"
# (MLflow parent run id, job index) of the sweep job running in this context: its run is a child.
# A context variable, not the environment: jobs of the parallel launcher run in threads side by side.
SWEEP_PARENT: contextvars.ContextVar[Optional[tuple[str, str]]] = contextvars.ContextVar("rlhf_sweep_parent", default=None)
# (sweep dir, job index) of the sweep job running in this context: its W&B group (rlhf.track.sweep_group).
SWEEP_GROUP: contextvars.ContextVar[Optional[tuple[str, str]]] = contextvars.ContextVar("rlhf_sweep_group", default=None)


def is_secret_key(key: str) -> bool:
    """A config key whose value must not be logged (``*token*``, ``*secret*``, ``*password*``,
    ``*api_key*`` ...); ``max_prompt_tokens`` and the like are counts, not secrets."""
    leaf = key.rsplit(".", 1)[-1].lower()
    if not any(w in leaf for w in SECRET_WORDS):
        return False
    if "token" in leaf and not any(w in leaf for w in SECRET_WORDS if w != "token"):
        return not (leaf.endswith("tokens") or "token_id" in leaf or leaf.startswith(("pad_", "eos_", "bos_"))
                    or leaf.startswith(("max_", "min_", "num_", "n_")))
    return True


def redact_url(value: str) -> str:
    """``scheme://user:pass@host`` -> ``scheme://user:***@host``; ``?token=...`` query values too."""
    import re

    value = re.sub(r"(://[^/:@\s]+):[^/@\s]+@", r"\1:" + REDACTED + "@", value)
    return re.sub(r"((?:token|key|secret|password|sig|signature)=)[^&\s,\]']+", r"\1" + REDACTED, value,
                  flags=re.IGNORECASE)


def redact(params: dict[str, Any]) -> dict[str, Any]:
    return {k: (REDACTED if is_secret_key(k) and v not in (None, "", "None") else
                redact_url(v) if isinstance(v, str) else v) for k, v in params.items()}


def _raw_params(spec: RunSpec) -> dict[str, Any]:
    from rlhf.spec.build import config_dict, flatten, to_dict

    params = flatten(config_dict(spec))
    params.update(flatten({"batch": to_dict(spec.batch)}, "derived."))
    params["derived.roles"] = ",".join(spec.roles)
    params["derived.rollout_engine"] = spec.rollout_engine
    params.update({f"derived.{d.key}": d.value for d in getattr(spec, "auto", ())})  # what auto chose
    return params


def _redact_value(key: str, value: Any) -> Any:
    if is_secret_key(key) and value not in (None, "", "None"):
        return REDACTED
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, (list, tuple)):  # a list of URLs (reward.remote.urls) may hold credentials
        return [_redact_value(key, v) for v in value]
    if isinstance(value, dict):
        return {k: _redact_value(f"{key}.{k}", v) for k, v in value.items()}
    return value


def typed_params(spec: RunSpec) -> dict[str, Any]:
    """The flattened config and ``derived.*`` values with their types (W&B's config), secrets redacted."""
    return {k: _redact_value(k, v) for k, v in _raw_params(spec).items()}


def string_params(spec: RunSpec) -> dict[str, str]:
    """The same as strings of at most 6000 characters (MLflow's params, TensorBoard's config text)."""
    return redact({k: str(v)[:6000] for k, v in _raw_params(spec).items()})

"""Bad run-time inputs (beyond the config errors of tests/cli): data files, reward code, model
paths, output dirs. Each is tested at the layer the driver goes through (``rlhf.preflight``, the
data readers, ``rlhf.rewards.Rewards``), for a ``UserError`` of one line that names the value and
the fix; ``rlhf.run`` turns a UserError into exit code 2 (tested end to end in
test_cli_preflight.py, before any Ray process starts)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf.spec.errors import UserError
from tests.helpers import assert_clear
from tests.reliability.conftest import variant

# ----------------------------------------------------------------------------- data files

# (file name, content as bytes, prompt_key, substrings of the message)
DATA = [
    ("empty.jsonl", b"", "prompt", ["empty.jsonl is empty (no rows)", "remove it from data.train_files"]),
    ("blank.jsonl", b"\n  \n\n", "prompt", ["blank.jsonl is empty (no rows)"]),
    ("latin1.jsonl", '{"prompt": "café"}\n'.encode("latin-1"), "prompt",
     ["latin1.jsonl, line 1: not valid UTF-8 (byte 0xe9", "Save the file as UTF-8"]),
    ("latin1.csv", "prompt\ncafé\n".encode("latin-1"), "prompt", ["latin1.csv: not valid UTF-8", "Save the file as UTF-8"]),
    ("badline.jsonl", b'{"prompt": "a"}\n{"prompt": "b",\n', "prompt",
     ["badline.jsonl, line 2: not valid JSON", "one JSON object"]),
    ("lines.json", b'{"prompt": "a"}\n{"prompt": "b"}\n', "prompt", ["lines.json: not valid JSON", "name it .jsonl"]),
    ("scalar.json", b"42", "prompt", ["scalar.json: expected a list of objects, got int"]),
    ("object.json", b'{"x": 1}', "prompt", ["object.json: expected a list of objects", "got an object with keys x"]),
    ("ragged.json", b'{"prompt": ["a", "b"], "answer": ["x"]}', "prompt", ["ragged.json: the columns have different lengths"]),
    ("strings.jsonl", b'"just text"\n', "prompt", ["strings.jsonl, row 0: expected an object", "one JSON object per row"]),
    ("notparquet.parquet", b"PAR1 not really", "prompt", ["notparquet.parquet: cannot read as parquet"]),
    ("prompts.txt", b"hello\n", "prompt", ["prompts.txt: unknown format", ".jsonl"]),
    ("nokey.jsonl", b'{"question": "a", "answer": "b"}\n', "prompt",
     ["nokey.jsonl' has no column 'prompt' (columns: answer, question)", "data.prompt_key=question",
      "data.columns=[question:prompt]"]),
    # no usual prompt name: the column of the longest text, not the first by name
    ("noname.jsonl", b'{"a_label": "yes", "body": "a long question about keys and maps"}\n', "prompt",
     ["data.prompt_key=body", "data.columns=[body:prompt]"]),
    ("nokey.csv", b"question,answer\na,b\n", "prompt", ["has no column 'prompt'", "data.prompt_key=question"]),
    ("wrongkey.jsonl", b'{"prompt": "a"}\n', "query", ["has no column 'query' (columns: prompt)", "data.prompt_key"]),
    # row-level problems: rlhf.preflight.check_prompt_rows
    ("onemissing.jsonl", b'{"prompt": "key k1"}\n{"text": "key k2"}\n', "prompt",
     ["onemissing.jsonl, row 1: no 'prompt' (keys: text)", "data.prompt_key"]),
    ("int.jsonl", b'{"prompt": "key k1"}\n{"prompt": 7}\n', "prompt",
     ["int.jsonl, row 1: 'prompt' should be a string (or a list of chat messages), got int (7)"]),
    ("dict.jsonl", b'{"prompt": {"text": "key k1"}}\n', "prompt", ["dict.jsonl, row 0: 'prompt' should be a string", "got dict"]),
    ("null.jsonl", b'{"prompt": "key k1"}\n{"prompt": null}\n', "prompt", ["null.jsonl, row 1: no 'prompt'"]),
    ("emptyprompt.jsonl", b'{"prompt": "key k1"}\n{"prompt": "  "}\n', "prompt",
     ["emptyprompt.jsonl, row 1: 'prompt' is empty", "Remove the row"]),
    ("msgs.jsonl", b'{"prompt": ["key k1"]}\n', "prompt", ["msgs.jsonl, row 0: 'prompt', message 0: expected {\"role\""]),
    ("msgnocontent.jsonl", b'{"prompt": [{"role": "user"}]}\n', "prompt", ["message 0: expected {\"role\": ..., \"content\""]),
    ("msgempty.jsonl", b'{"prompt": []}\n', "prompt", ["'prompt' should be a non-empty list of {role, content} messages"]),
    ("dupids.jsonl", b'{"id": 1, "prompt": "key k1"}\n{"id": 2, "prompt": "key k2"}\n{"id": 1, "prompt": "key k3"}\n',
     "prompt", ["dupids.jsonl, row 2: duplicate id 1 (also row 0)", "Give every row its own id"]),
]


@pytest.mark.parametrize("name,content,key,parts", DATA, ids=[d[0] for d in DATA])
def test_bad_data_file(base_spec, tokenizer, tmp_path, name, content, key, parts):
    from rlhf.preflight import check_prompts

    f = tmp_path / name
    f.write_bytes(content)
    spec = variant(base_spec, data={"train_files": (str(f),), "prompt_key": key})
    with pytest.raises(UserError) as e:
        check_prompts(spec, tokenizer)
    assert_clear(str(e.value), *parts)


def test_missing_data_file_lists_neighbours(base_spec, tokenizer, tmp_path):
    from rlhf.preflight import check_prompts

    (tmp_path / "train.jsonl").write_text('{"prompt": "key k1"}\n')
    spec = variant(base_spec, data={"train_files": (str(tmp_path / "trian.jsonl"),)})
    with pytest.raises(UserError) as e:
        check_prompts(spec, tokenizer)
    assert_clear(str(e.value), "trian.jsonl does not exist", "Files in", "train.jsonl", "data.train_files")


def test_directory_that_is_not_a_dataset(base_spec, tokenizer, tmp_path):
    from rlhf.preflight import check_prompts

    (tmp_path / "d").mkdir()
    spec = variant(base_spec, data={"train_files": (str(tmp_path / "d"),)})
    with pytest.raises(UserError) as e:
        check_prompts(spec, tokenizer)
    assert_clear(str(e.value), "is a directory but not a dataset written by datasets' save_to_disk")


def _rows_file(tmp_path, prompts):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "answer": "v1"}) + "\n" for p in prompts))
    return f


def test_all_prompts_over_the_length_limit_is_an_error(base_spec, tokenizer, tmp_path):
    from rlhf.preflight import check_prompts

    f = _rows_file(tmp_path, ["key " + " ".join(["k1"] * 40)] * 3)
    spec = variant(base_spec, data={"train_files": (str(f),)}, rollout={"max_prompt_tokens": 16})
    with pytest.raises(UserError) as e:
        check_prompts(spec, tokenizer)
    assert_clear(str(e.value), "all 3 prompts", "longer than rollout.max_prompt_tokens=16",
                 "Raise rollout.max_prompt_tokens")


def test_long_prompts_are_counted_then_dropped(base_spec, tokenizer, tmp_path):
    from rlhf.data.prompts import PromptSource
    from rlhf.preflight import check_prompts, long_prompt_filter

    f = _rows_file(tmp_path, ["key k1", "key " + " ".join(["k2"] * 40), "key k3", "key " + " ".join(["k4"] * 30)])
    spec = variant(base_spec, data={"train_files": (str(f),)}, rollout={"max_prompt_tokens": 16})
    assert check_prompts(spec, tokenizer) == {str(f): 2}
    src = PromptSource(spec.data, 0)
    assert src.drop(long_prompt_filter(spec, tokenizer)) == 2
    served = {r["prompt"] for r in src.next(8)}
    assert served == {"key k1", "key k3"}


def test_chat_messages_need_a_chat_template(base_spec, tmp_path):
    from rlhf.preflight import check_model

    tok_dir = _tokenizer_dir(base_spec, tmp_path, chat_template=False)
    spec = variant(base_spec, model={"path": str(tok_dir)}, data={"chat_template": True})
    with pytest.raises(UserError) as e:
        check_model(spec, needs_chat_template=True)
    assert_clear(str(e.value), f"model.path={tok_dir} has no chat template", "data.chat_template=false")


# ----------------------------------------------------------------------------- model paths


def _tokenizer_dir(base_spec, tmp_path, pad=True, chat_template=True) -> Path:
    """A copy of the tiny model's config + tokenizer, without pad/eos or chat template if asked."""
    from transformers import AutoTokenizer

    from rlhf.models import resolve_model_path

    src = Path(resolve_model_path(base_spec.model.path, base_spec.model))
    out = tmp_path / ("tok" + ("" if pad else "-nopad") + ("" if chat_template else "-nochat"))
    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    shutil.copy(src / "model.safetensors", out / "model.safetensors")
    tok = AutoTokenizer.from_pretrained(src)
    if not pad:
        tok.pad_token = None
        tok.eos_token = None
    if not chat_template:
        tok.chat_template = None
    tok.save_pretrained(out)
    if not pad:  # save_pretrained may keep the special tokens map: drop pad/eos there too
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            p = out / name
            if p.exists():
                d = json.loads(p.read_text())
                for k in ("pad_token", "eos_token"):
                    d.pop(k, None)
                p.write_text(json.dumps(d))
    return out


def test_model_path_missing(base_spec, tmp_path):
    from rlhf.preflight import check_model

    with pytest.raises(UserError) as e:
        check_model(variant(base_spec, model={"path": str(tmp_path / "nope")}))
    assert_clear(str(e.value), f"model path '{tmp_path / 'nope'}' does not exist", "model.path=builtin:tiny")


def test_model_path_is_not_a_checkpoint(base_spec, tmp_path):
    from rlhf.preflight import check_model

    (tmp_path / "weights").mkdir()
    with pytest.raises(UserError) as e:
        check_model(variant(base_spec, model={"path": str(tmp_path / "weights")}))
    assert_clear(str(e.value), "is not a Hugging Face checkpoint: it has no config.json", "save_pretrained")


def test_model_path_is_a_file(base_spec, tmp_path):
    from rlhf.preflight import check_model

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(UserError) as e:
        check_model(variant(base_spec, model={"path": str(f)}))
    assert_clear(str(e.value), "model.safetensors' is not a Hugging Face checkpoint")


def test_checkpoint_without_a_tokenizer(base_spec, tmp_path):
    from rlhf.models import resolve_model_path
    from rlhf.preflight import check_model

    src = Path(resolve_model_path(base_spec.model.path, base_spec.model))
    (tmp_path / "m").mkdir()
    shutil.copy(src / "config.json", tmp_path / "m" / "config.json")
    shutil.copy(src / "model.safetensors", tmp_path / "m" / "model.safetensors")
    with pytest.raises(UserError) as e:
        check_model(variant(base_spec, model={"path": str(tmp_path / "m")}))
    assert_clear(str(e.value), f"cannot load a tokenizer from '{tmp_path / 'm'}'")


def test_tokenizer_without_pad_or_eos_token(base_spec, tmp_path):
    from rlhf.preflight import check_model

    d = _tokenizer_dir(base_spec, tmp_path, pad=False)
    with pytest.raises(UserError) as e:
        check_model(variant(base_spec, model={"path": str(d)}))
    assert_clear(str(e.value), f"model.path={d} has neither a pad token nor an EOS token", "add_special_tokens")


def test_a_tokenizer_larger_than_the_models_vocabulary(base_spec, tmp_path):
    """A tokenizer that is not the model's: its ids past the model's vocab_size have no embedding
    row (it was an IndexError in a worker's first pass)."""
    from rlhf.models import resolve_model_path
    from rlhf.preflight import check_model

    src = Path(resolve_model_path(base_spec.model.path, base_spec.model))
    d = tmp_path / "m"
    shutil.copytree(src, d)
    config = json.loads((d / "config.json").read_text())
    check_model(variant(base_spec, model={"path": str(d)}))  # its own tokenizer fits
    config["vocab_size"] = 8
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        check_model(variant(base_spec, model={"path": str(d)}))
    assert_clear(str(e.value), f"model.path={d} has", "tokens but the model's vocab_size is 8",
                 "Use the tokenizer saved with this model")


# ----------------------------------------------------------------------------- output dir


def test_output_dir_under_a_file(tmp_path):
    from rlhf.preflight import check_output_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError) as e:
        check_output_dir(str(tmp_path / "f" / "run"))
    assert_clear(str(e.value), f"output_dir={tmp_path / 'f' / 'run'} is not writable", "output_dir=<path>")


def test_output_dir_is_a_file(tmp_path):
    from rlhf.preflight import check_output_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError) as e:
        check_output_dir(str(tmp_path / "f"))
    assert_clear(str(e.value), f"output_dir={tmp_path / 'f'} is not", "output_dir=<path>")


def test_output_dir_read_only(tmp_path):
    import os

    from rlhf.preflight import check_output_dir

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):  # root writes anyway: use a read-only filesystem instead
            target = "/proc/rlhf-run"
        else:
            target = str(ro / "run")
        with pytest.raises(UserError) as e:
            check_output_dir(target)
        assert_clear(str(e.value), f"output_dir={target} is not writable")
    finally:
        ro.chmod(0o755)


# ----------------------------------------------------------------------------- reward code

REWARD_FILES = {
    "syntax.py": "def reward(prompts, responses, **kw)\n    return [0.0]\n",
    "importfail.py": "import definitely_not_a_module_xyz\n\ndef reward(prompts, responses, **kw):\n    return [0.0]\n",
    "raises_at_import.py": "raise RuntimeError('config missing')\n",
    "notcallable.py": "reward = 3\n",
    "ok.py": "def other(prompts, responses, **kw):\n    return [0.0] * len(responses)\n",
}

LOAD = [
    ("no_colon", "rewards_without_function", ["write module:function or path/to/file.py:function"]),
    ("no_module", "no_such_module_xyz:reward",
     ["cannot import module 'no_such_module_xyz'", "give a file path: path/to/file.py:function"]),
    ("no_file", "{d}/missing.py:reward", ["file '{d}/missing.py' does not exist"]),
    ("syntax", "{d}/syntax.py:reward", ["importing {d}/syntax.py failed: SyntaxError"]),
    ("import_error", "{d}/importfail.py:reward",
     ["importing {d}/importfail.py failed: ModuleNotFoundError", "definitely_not_a_module_xyz"]),
    ("raises_at_import", "{d}/raises_at_import.py:reward", ["failed: RuntimeError: config missing"]),
    ("not_callable", "{d}/notcallable.py:reward", ["has no function 'reward'"]),
    ("no_function", "{d}/ok.py:reward", ["{d}/ok.py has no function 'reward'"]),
    ("module_no_function", "rlhf.rewards.builtin:nope", ["rlhf.rewards.builtin has no function 'nope'"]),
]


@pytest.fixture
def reward_dir(tmp_path):
    for name, text in REWARD_FILES.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("ref,parts", [(r, p) for _, r, p in LOAD], ids=[i for i, _, _ in LOAD])
def test_reward_function_that_does_not_load(base_spec, reward_dir, ref, parts):
    from rlhf.preflight import check_rewards

    ref = ref.format(d=reward_dir)
    spec = variant(base_spec, reward={"functions": (SimpleNamespace(fn=ref, weight=1.0, name=None),)})
    with pytest.raises(UserError) as e:
        check_rewards(spec)
    assert_clear(str(e.value), f"reward function {ref!r}", *[p.format(d=reward_dir) for p in parts])


def test_environment_class_that_does_not_load(base_spec, reward_dir):
    """env.fn (multi-turn environments) goes through the same loader, before Ray starts."""
    from rlhf.preflight import check_rewards

    ref = f"{reward_dir}/importfail.py:Env"
    spec = variant(base_spec, reward={"functions": ()}, env={"fn": ref})
    with pytest.raises(UserError) as e:
        check_rewards(spec)
    assert_clear(str(e.value), f"{ref!r}", "ModuleNotFoundError", "definitely_not_a_module_xyz")


def _rewards(tmp_path, body: str, timeout_s: float = 60.0):
    from rlhf.rewards import Rewards

    f = tmp_path / "r.py"
    f.write_text("import math, time\n\ndef reward(prompts, responses, **kw):\n" + body + "\n")
    spec = SimpleNamespace(functions=[SimpleNamespace(fn=f"{f}:reward", weight=1.0, name=None)],
                           timeout_s=timeout_s, remote=None)
    return Rewards(spec), f"{f}:reward"


SCORE = [
    ("exception", "    raise KeyError('answer')", ["raised KeyError: 'answer' (at ", "r.py:4)."]),
    ("type_error_inside", "    return [len(r) + 'x' for r in responses]", ["raised TypeError: unsupported operand"]),
    ("sys_exit", "    raise SystemExit(0)", ["called sys.exit(0) (at ", "must not end its process"]),
    ("nan", "    return [float('nan')] * len(responses)", ["returned a non-finite value (nan) for response 0",
                                                            "return finite numbers"]),
    ("inf", "    return [0.0, math.inf, 0.0]", ["returned a non-finite value (inf) for response 1"]),
    ("too_few", "    return [1.0]", ["returned 1 values for 3 responses", "one number per response"]),
    ("too_many", "    return [1.0] * 5", ["returned 5 values for 3 responses"]),
    ("none", "    return None", ["returned NoneType, not a list of numbers"]),
    ("strings", "    return ['good'] * len(responses)", ["returned list, not a list of numbers"]),
]


@pytest.mark.parametrize("body,parts", [(b, p) for _, b, p in SCORE], ids=[i for i, _, _ in SCORE])
def test_reward_function_fails_while_scoring(tmp_path, body, parts):
    rewards, ref = _rewards(tmp_path, body)
    try:
        with pytest.raises(UserError) as e:
            rewards.score(["p"] * 3, ["a", "b", "c"], {"answer": ["x"] * 3})
        assert_clear(str(e.value), f"reward function {ref}", *parts)
    finally:
        rewards.close()


def test_reward_function_error_names_the_signature_only_when_the_call_does_not_fit(tmp_path):
    rewards, ref = _rewards(tmp_path, "    raise TypeError('inside')")
    try:
        with pytest.raises(UserError) as e:
            rewards.score(["p"], ["a"], {})
        assert "signature" not in str(e.value) and "cannot be called" not in str(e.value)
    finally:
        rewards.close()
    f = tmp_path / "two.py"
    f.write_text("def reward(prompts):\n    return [0.0] * len(prompts)\n")
    from rlhf.rewards import Rewards

    rewards = Rewards(SimpleNamespace(functions=[SimpleNamespace(fn=f"{f}:reward", weight=1.0, name=None)],
                                      timeout_s=60.0, remote=None))
    try:
        with pytest.raises(UserError) as e:
            rewards.score(["p"], ["a"], {})
        assert_clear(str(e.value), f"reward function {f}:reward cannot be called as fn(prompts: list[str], "
                                   "responses: list[str], **metadata) -> list[float]", "TypeError")
    finally:
        rewards.close()


def test_a_tiny_timeout_times_out_even_when_the_function_returns_first(tmp_path):
    """reward.timeout_s=1e-6: the call returns before the wait begins, but it took longer than that."""
    rewards, ref = _rewards(tmp_path, "    return [1.0] * len(responses)", timeout_s=1e-6)
    try:
        with pytest.raises(UserError) as e:
            rewards.score(["p"], ["a"], {})
        assert_clear(str(e.value), f"reward function {ref} took more than reward.timeout_s=1e-06 s")
    finally:
        rewards.close()


def test_reward_function_that_hangs_times_out_and_cannot_block_exit(tmp_path):
    rewards, ref = _rewards(tmp_path, "    time.sleep(3600)", timeout_s=0.5)
    t = time.monotonic()
    with pytest.raises(UserError) as e:
        rewards.score(["p"], ["a"], {})
    assert time.monotonic() - t < 10
    rewards.close()
    assert_clear(str(e.value), f"reward function {ref} took more than reward.timeout_s=0.5 s",
                 "raise reward.timeout_s")
    # the abandoned call must not keep the interpreter from exiting: its process is killed, and
    # the thread that waited on it is a daemon (non-daemon threads are joined at exit)
    assert rewards.executor.pid is None
    hung = [th for th in threading.enumerate() if th.name.startswith("reward") and th.is_alive()]
    assert all(th.daemon for th in hung)


def test_reward_function_that_hangs_in_the_driver_cannot_block_exit(tmp_path):
    """reward.isolate=false: the call runs in a daemon thread of the driver, left behind on timeout."""
    from rlhf.rewards import Rewards

    f = tmp_path / "r.py"
    f.write_text("import time\n\ndef reward(prompts, responses, **kw):\n    time.sleep(3600)\n")
    rewards = Rewards(SimpleNamespace(functions=[SimpleNamespace(fn=f"{f}:reward", weight=1.0, name=None)],
                                      timeout_s=0.5, remote=None, isolate=False))
    with pytest.raises(UserError, match="took more than reward.timeout_s=0.5 s"):
        rewards.score(["p"], ["a"], {})
    rewards.close()
    hung = [th for th in threading.enumerate() if th.name == "reward" and th.is_alive()]
    assert hung and all(th.daemon for th in hung)


def test_remote_reward_server_down_retries_then_clear_error():
    """Through ``Rewards`` (reward.remote, as the RL loop scores) when the envs engineer's config is
    there, else the client alone: retried with backoff, then one line naming the URL and a fix."""
    import socket

    from rlhf.rewards.remote import RemoteReward

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    client = RemoteReward([url], retries=2, backoff_s=0.1, timeout_s=2)
    t = time.monotonic()
    with pytest.raises(UserError) as e:
        client(["p"], ["a"])
    waited = time.monotonic() - t
    assert waited >= 0.1 + 0.2 - 0.01  # backoff 0.1 s, then 0.2 s
    assert_clear(str(e.value), f"reward servers {url} did not answer after 3 attempts", "rlhf-reward-server",
                 "reward.remote.urls")


def test_at_least_40_bad_inputs():
    import sys

    mod = sys.modules[__name__]
    singles = [n for n in dir(mod) if n.startswith("test_") and n not in (
        "test_bad_data_file", "test_reward_function_that_does_not_load", "test_reward_function_fails_while_scoring",
        "test_at_least_40_bad_inputs")]
    assert len(DATA) + len(LOAD) + len(SCORE) + len(singles) >= 40

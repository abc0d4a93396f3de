"""Hugging Face Hub ids for models and data sets, without network.

* the HF cache, written by the test in huggingface_hub's layout, with HF_HUB_OFFLINE=1: a PPO run
  (policy, critic init and reward model from one Hub id; prompts from a Hub data set) end to end;
* a local stand-in Hub (tests/hub/hubserver.py, HF_ENDPOINT) serves a model and a data set, so the
  download path runs for real: resolution and preflight, then the same again offline from the cache;
* every failure (unknown repo, gated without a token, offline and not cached, revision not found,
  no disk room, Hub unreachable, unknown config/split, a checkpoint without weights) is one line
  with the fix, and through ``rlhf-run`` exit code 2 before Ray starts.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf.spec.errors import UserError
from tests.hub.hubserver import HubServer, Repo, write_cache
from tests.helpers import assert_clear, make_spec, run_rl

MODEL, DATA = "rlhf-test/tiny", "rlhf-test/keymap"
TOKEN = "hf_test_secret_token_0123456789"
CARD = """---
configs:
- config_name: keymap
  data_files:
  - split: train
    path: keymap/train-*
  - split: eval
    path: keymap/eval-*
- config_name: other
  data_files: other/*.parquet
---
The built-in key-to-value task, with the prompt column named `question`.
"""


def _parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def repos(rlhf_cache, tmp_path_factory):
    """The built-in tiny model's files as a model repo (plus files a download must skip), and the
    built-in task's prompts as a data set repo with two configs."""
    from rlhf.data.builtin import data_file
    from rlhf.models.builtin import builtin_model_dir

    spec = make_spec([], tmp_path_factory.mktemp("base") / "run")
    model = {p.name: p.read_bytes() for p in builtin_model_dir("tiny", spec.model).iterdir()}
    extra = {"pytorch_model.bin": b"\0" * 64, "original/consolidated.00.pth": b"\0" * 64}
    rows = {s: [{"question": r["prompt"], "answer": r["answer"]}
                for r in map(json.loads, data_file(f"keymap/{s}").read_text().splitlines())]
            for s in ("train", "eval")}
    data = {"README.md": CARD.encode(), "keymap/train-00000-of-00001.parquet": _parquet(rows["train"]),
            "keymap/eval-00000-of-00001.parquet": _parquet(rows["eval"]),
            "other/all.parquet": _parquet([{"question": "x", "answer": "y"}])}
    return {"model": model, "extra": extra, "data": data, "rows": rows}


@pytest.fixture
def hf_env(tmp_path, monkeypatch):
    """An empty HF_HOME, no token, online, and no Hub unless a test starts one."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    for k in ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
              "HF_DATASETS_CACHE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    from rlhf.data import hub as data_hub

    monkeypatch.setattr(data_hub, "_FETCHED", {})  # this process's memo of fetched data sets
    return home


def _hub(repos, **model_kw):
    return HubServer({("model", MODEL): Repo({**repos["model"], **repos["extra"]}),
                      ("model", "rlhf-test/gated"): Repo(repos["model"], gated=True),
                      ("model", "rlhf-test/huge"): Repo(repos["model"], sizes={"model.safetensors": 10 ** 16}),
                      ("dataset", DATA): Repo(repos["data"])}, token=TOKEN)


# ----------------------------------------------------------------------------- the cache, offline, end to end


def test_offline_cache_runs_ppo_end_to_end(rl_env, repos, hf_env, tmp_path, monkeypatch, capfd):
    """Model, critic init, reward model and prompts by Hub id, from a cache written by hand."""
    model = Repo(repos["model"])
    snap = write_cache(hf_env / "hub", "model", MODEL, model)
    write_cache(hf_env / "hub", "dataset", DATA, Repo(repos["data"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    code, rows = run_rl(["algo=ppo", "train.steps=2", "train.prompts_per_step=8", "rollout.max_response_tokens=4",
                         f"model.path={MODEL}", f"reward.model_path={MODEL}", "reward.model_weight=0.1",
                         f"data.train_files=[hub:{DATA}:keymap:train]", "data.columns=[question:prompt]",
                         "tracking.backend=none"], out)
    text = capfd.readouterr()
    assert code == 0, text.err[-3000:]
    assert len(rows) == 2 and all("critic/value_loss" in r and "reward/mean" in r for r in rows)
    import yaml

    spec = yaml.safe_load((out / "spec.yaml").read_text())
    for role in ("model", "reward"):  # the workers were given the driver's snapshot
        assert spec["models"][role] == {"path": str(snap), "repo": MODEL, "commit": model.commit}
    assert f"model.path: {MODEL} at commit {model.commit[:12]} ({snap})" in text.out
    assert (out / "final" / "hf" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- a stand-in Hub: the download path


def test_download_from_the_hub_then_offline_from_the_cache(repos, hf_env, tmp_path, monkeypatch, capsys):
    from rlhf.data.prompts import read_rows
    from rlhf.models import load_tokenizer
    from rlhf.preflight import check_prompts, preflight, resolve_models

    local = tmp_path / "local.jsonl"
    local.write_text('{"prompt": "key k1", "answer": "v1"}\n')
    overrides = [f"model.path={MODEL}", f"data.train_files=[hub:{DATA}:keymap:train,{local}]",
                 "data.columns=[question:prompt]", "tracking.backend=none"]
    server = _hub(repos)
    with server as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        spec = resolve_models(make_spec(overrides, tmp_path / "run"), SimpleNamespace(print=print))
        assert preflight(spec) is None  # RL: model, tokenizer, every prompt row, rewards
        rows = read_rows(f"hub:{DATA}:keymap:train", "prompt", ["question:prompt"])
    snap = Path(spec.models["model"].path)
    assert spec.models["model"].commit == server.repos[("model", MODEL)].commit and snap.parent.name == "snapshots"
    assert sorted(os.listdir(snap)) == sorted(repos["model"])  # one set of weights, nothing from original/
    assert [r["prompt"] for r in rows] == [r["question"] for r in repos["rows"]["train"]]
    data_snap = next((hf_env / "hub" / "datasets--rlhf-test--keymap" / "snapshots").iterdir())
    assert sorted(str(p.relative_to(data_snap)) for p in data_snap.rglob("*.parquet")) == [
        "keymap/eval-00000-of-00001.parquet", "keymap/train-00000-of-00001.parquet"]  # not other/
    out = capsys.readouterr().out
    assert "model.path: downloading rlhf-test/tiny@main (" in out and (hf_env / "datasets").is_dir()  # Arrow copy
    assert f"data file hub:{DATA}:keymap:train: downloading {DATA}@main (" in out
    assert not [r for r in server.requests if r[2]]  # no token was set, none was sent
    # the Hub gone and offline: the same snapshot, from the cache alone
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from rlhf.data import hub as data_hub

    monkeypatch.setattr(data_hub, "_FETCHED", {})
    again = resolve_models(make_spec(overrides, tmp_path / "run2"))
    assert again.models["model"].path == str(snap)
    assert sum(check_prompts(again, load_tokenizer(str(snap))).values()) == 0


def test_a_gated_repo_downloads_with_the_token_and_never_prints_it(repos, hf_env, monkeypatch, capfd):
    from rlhf.models.load import resolve_model

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    server = _hub(repos)
    with server as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        r = resolve_model("rlhf-test/gated", None, say=print)
    assert (Path(r.path) / "model.safetensors").is_file()
    assert any(auth for method, path, auth in server.requests if "/resolve/" in path)
    out = capfd.readouterr()
    assert TOKEN not in out.out + out.err


def test_a_node_without_the_drivers_snapshot_fetches_that_commit(repos, hf_env, monkeypatch):
    """model_dir on another node: the driver's dir is not there, so the worker fetches the same
    commit into its own HF cache (here: from the stand-in Hub), not whatever main is now."""
    from rlhf.models import model_dir
    from rlhf.spec.build import ResolvedModel

    server = _hub(repos)
    commit = server.repos[("model", MODEL)].commit
    spec = SimpleNamespace(model=SimpleNamespace(path=MODEL, revision=None), reward=None,
                           models={"model": ResolvedModel(path="/on/the/driver/only", repo=MODEL, commit=commit)})
    with server as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        path = model_dir(spec)
    assert path == str(hf_env / "hub" / "models--rlhf-test--tiny" / "snapshots" / commit)
    assert any(f"/resolve/{commit}/model.safetensors" in p for m, p, _ in server.requests if m == "GET")


# ----------------------------------------------------------------------------- one line per failure

ERRORS = [  # (name, model id or data file, revision, env, message parts)
    ("unknown_repo", "nobody/nothing", None, {},
     ["model.path=nobody/nothing: no local dir 'nobody/nothing', and no model repo 'nobody/nothing' on the Hugging "
      "Face Hub (a private repo needs HF_TOKEN)", "Check the id"]),
    ("gated_no_token", "rlhf-test/gated", None, {},
     ["rlhf-test/gated is a gated model repo and no token is set (HF_TOKEN", "Accept its terms at http://127.0.0.1:",
      "/rlhf-test/gated, then set HF_TOKEN"]),
    ("gated_wrong_token", "rlhf-test/gated", None, {"HF_TOKEN": "hf_wrong"},
     ["gated model repo and the token in use has no access to it"]),
    ("revision_not_found", MODEL, "v9", {},
     ["rlhf-test/tiny has no revision 'v9'", "Give a branch, tag or commit of the repo in model.revision"]),
    ("disk_full", "rlhf-test/huge", None, {},
     ["model.path=rlhf-test/huge: not enough disk space in", "needed", "free). Free space there, or set HF_HOME"]),
    ("offline_not_cached", MODEL, None, {"HF_HUB_OFFLINE": "1"},
     ["model.path=rlhf-test/tiny: no local dir 'rlhf-test/tiny', and rlhf-test/tiny is not in the Hugging Face "
      "cache (", "HF_HUB_OFFLINE=1 forbids downloading it",
      "Unset HF_HUB_OFFLINE", "hf download rlhf-test/tiny"]),
    ("hub_unreachable", MODEL, None, {"HF_ENDPOINT": "http://127.0.0.1:9"},
     ["cannot reach the Hugging Face Hub at http://127.0.0.1:9 (ConnectError", "not in the cache"]),
    ("data_unknown_repo", "hub:nobody/nothing:train", None, {},
     ["data file hub:nobody/nothing:train: no data set repo 'nobody/nothing' on the Hugging Face Hub"]),
    ("data_offline", f"hub:{DATA}:keymap:train", None, {"HF_HUB_OFFLINE": "1"},
     [f"{DATA} is not in the Hugging Face cache", "hf download rlhf-test/keymap --repo-type dataset"]),
    ("data_unknown_config", f"hub:{DATA}:nope:train", None, {},
     [f"data file hub:{DATA}:nope:train: {DATA} has no config 'nope' (keymap, other). Name one: "
      f"hub:{DATA}:keymap:train."]),
    ("data_no_config", f"hub:{DATA}:train", None, {}, [f"{DATA} has several configs (keymap, other)"]),
    ("data_unknown_split", f"hub:{DATA}:keymap:test", None, {},
     [f"{DATA} has no split 'test' (splits: train, eval)", "hub:<org>/<name>[@<revision>][:<config>]:<split>"]),
    ("data_bad_syntax", "hub:a/b/c:train", None, {},
     ["data file hub:a/b/c:train: not a Hub data set name. Write hub:"]),
]


@pytest.mark.parametrize("name,target,revision,env,parts", ERRORS, ids=[e[0] for e in ERRORS])
def test_each_failure_is_one_line_with_the_fix(repos, hf_env, monkeypatch, name, target, revision, env, parts):
    from rlhf.data.hub import load_rows
    from rlhf.models.load import resolve_model

    with _hub(repos) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(UserError) as e:
            if target.startswith("hub:"):
                load_rows(target)
            else:
                resolve_model(target, None, revision=revision)
    assert_clear(str(e.value), *parts)
    assert TOKEN not in str(e.value)
    if name == "disk_full":  # refused before any byte was written
        assert not list((hf_env / "hub").rglob("blobs/*"))


def test_a_checkpoint_dir_without_weights_fails_preflight(repos, tmp_path):
    from rlhf.models.load import resolve_model

    d = tmp_path / "ckpt"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes(repos["model"][name])
    with pytest.raises(UserError) as e:
        resolve_model(str(d))
    assert_clear(str(e.value), f"model path '{d}' has a config.json but no weights (model.safetensors",
                 "save_pretrained")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (d / "model-00001-of-00002.safetensors").write_bytes(b"x")
    with pytest.raises(UserError) as e:
        resolve_model(str(d))
    assert_clear(str(e.value), "1 of the 2 weight files named in model.safetensors.index.json are missing "
                               "(model-00002-of-00002.safetensors)")


def test_a_hub_error_stops_rlhf_run_with_exit_2_before_ray(repos, hf_env, tmp_path, monkeypatch, capsys):
    import ray

    from rlhf import cli

    was_up = ray.is_initialized()
    with _hub(repos) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        code = cli.main([f"output_dir={tmp_path}/run", "tracking.backend=none", "tracking.console=plain",
                         "model.path=nobody/nothing"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: model.path=nobody/nothing: "), err
    assert ray.is_initialized() == was_up


# ----------------------------------------------------------------------------- the pieces


def test_model_files_take_one_set_of_weights():
    from rlhf.models.load import model_files

    names = ["config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin", "tf_model.h5",
             "original/consolidated.00.pth", "onnx/model.onnx", ".gitattributes"]
    assert sorted(model_files(names)) == [".gitattributes", "config.json", "model.safetensors", "tokenizer.json"]
    sharded = ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "consolidated.safetensors", "pytorch_model.bin.index.json",
               "pytorch_model-00001-of-00002.bin"]
    assert sorted(model_files(sharded)) == ["config.json", "model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                            "pytorch_model.bin.index.json"]


def test_hub_data_names_parse():
    from rlhf.data.hub import HubData, parse

    assert parse("hub:openai/gsm8k:main:train") == HubData("openai/gsm8k", None, "main", "train")
    assert parse("hub:openai/gsm8k@e53f048:main:test") == HubData("openai/gsm8k", "e53f048", "main", "test")
    assert parse("hub:org/name:validation") == HubData("org/name", None, None, "validation")
    assert parse("hub:org/name") == HubData("org/name", None, None, "train")
    for bad in ("hub:", "hub:org/name:", "hub:/abs:train", "hub:org/name@:train", "hub:a:b:c:d"):
        with pytest.raises(UserError, match="not a Hub data set name"):
            parse(bad)


def test_local_paths_are_not_hub_ids(tmp_path):
    from rlhf.hub import is_repo_id

    assert is_repo_id("Qwen/Qwen2.5-1.5B-Instruct") and is_repo_id("gpt2")
    for local in ("/abs/model", "./model", "~/model", "a/b/c", "../m", "outputs/run/final/hf"):
        assert not is_repo_id(local), local


def test_gsm8k_reward_reads_the_answer_after_the_marks():
    from rlhf.rewards.math import gsm8k_reward

    answers = ["She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "#### 1,200", "#### 5"]
    responses = ["So the answer is 7.", "The total is $1,200.", "It is 6"]
    assert gsm8k_reward(["q"] * 3, responses, answers) == [1.0, 1.0, 0.0]


def test_the_plan_says_where_a_hub_model_comes_from(repos, hf_env, capsys):
    from rlhf import cli

    argv = ["model=qwen2.5-1.5b", "hardware=1xh200", "--plan"]
    assert cli.main(argv) == 0
    assert (f"model.path from the Hugging Face Hub: downloaded when the run starts, into {hf_env / 'hub'} "
            "(set HF_HOME to move it)") in capsys.readouterr().out
    repo = Repo(repos["model"])
    write_cache(hf_env / "hub", "model", "Qwen/Qwen2.5-1.5B-Instruct", repo)
    assert cli.main(argv) == 0
    assert (f"model.path from the Hugging Face Hub: in the HF cache at commit {repo.commit[:12]} ({hf_env / 'hub'})"
            in capsys.readouterr().out)


def test_starting_ray_prints_no_token_authentication_warning(tmp_path):
    """A new local cluster (init_ray) keeps Ray's default token authentication but not its
    warning about it, which Ray logs on every start."""
    import subprocess
    import sys

    code = ("from rlhf.cli import build_spec, compose; from rlhf.launch.cluster import init_ray; import ray; "
            "ov = ['tracking.backend=none']; spec = build_spec(compose(ov), ov, plan=True); "
            "assert init_ray(spec); from ray._raylet import AuthenticationMode as M, get_authentication_mode as mode; "
            "print('token auth:', mode() == M.TOKEN); ray.shutdown()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "token auth: True" in r.stdout  # still on
    assert "Token authentication" not in r.stdout + r.stderr, r.stderr

"""checkpoint.push_to_hub against the stand-in Hub (tests/hub/hubserver.py): the run's final/hf,
its LoRA adapter and a model card arrive in one commit and download back byte for byte; a refused
token, a Hub failing mid-commit or no Hub at all is one line, and the run dir is left as it was.
(The push at the end of a real run is checked on the run tests/track/test_trackers.py shares.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.hub.hubserver import HubServer

TOKEN = "hf_test_write_token"


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "outputs" / "run"
    (run / "final" / "hf").mkdir(parents=True)
    (run / "final" / "adapter").mkdir(parents=True)
    (run / "final" / "hf" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (run / "final" / "hf" / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (run / "final" / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (run / "final" / "adapter" / "adapter_model.safetensors").write_bytes(b"\x01\x02" * 100)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.25, "kl/mean": 0.5}) + "\n")
    (run / "spec.yaml").write_text("algo:\n  name: grpo\nmodel:\n  name: qwen\n  path: Qwen/Qwen2.5-0.5B\n")
    return run


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _spec(repo: str):
    return SimpleNamespace(checkpoint=SimpleNamespace(push_to_hub=repo, hub_private=True))


def test_push_uploads_final_hf_adapter_and_card(tmp_path, monkeypatch):
    from huggingface_hub import snapshot_download

    from rlhf.hub_push import push_at_end

    run = _run_dir(tmp_path)
    with HubServer({}, token=TOKEN) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        lines: list[str] = []
        got = push_at_end(_spec("org/tiny-grpo"), run, lines.append)
        assert lines == [f"pushed to the Hub: {got}"] and "org/tiny-grpo/commit/" in got
        back = Path(snapshot_download("org/tiny-grpo", endpoint=url, cache_dir=tmp_path / "cache"))
    files = _digest(back)
    assert {k: v for k, v in files.items() if k != "README.md" and not k.startswith("adapter/")} == \
        _digest(run / "final" / "hf")
    assert {k[len("adapter/"):]: v for k, v in files.items() if k.startswith("adapter/")} == \
        _digest(run / "final" / "adapter")
    card = (back / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "base_model: Qwen/Qwen2.5-0.5B" in card
    assert "| reward/mean | 0.25 |" in card and "`adapter/` holds the LoRA adapter" in card


@pytest.mark.parametrize("case", ["bad token", "commit refused", "no hub"])
def test_a_failed_push_is_one_line_and_leaves_the_export(case, tmp_path, monkeypatch, capfd):
    from rlhf.hub_push import push_at_end

    run = _run_dir(tmp_path)
    before = _digest(run)
    lines: list[str] = []
    with HubServer({}, token=TOKEN, refuse_commits=case == "commit refused") as url:
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9" if case == "no hub" else url)
        monkeypatch.setenv("HF_TOKEN", "hf_wrong" if case == "bad token" else TOKEN)
        monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None, raising=False)
        assert push_at_end(_spec("org/m"), run, lines.append) is None
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("warning: the upload to the Hub (org/m) failed (")
    assert f"the model is intact in {run / 'final' / 'hf'}. Retry: rlhf-push {run} org/m" in lines[0]
    assert _digest(run) == before  # nothing added, moved or removed
    out, err = capfd.readouterr()
    assert "Retrying" not in out + err  # huggingface_hub's retry notices stay quiet


def test_rlhf_push_command(tmp_path, monkeypatch, capsys):
    from rlhf.hub_push import main

    run = _run_dir(tmp_path)
    with HubServer({}, token=TOKEN) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        assert main([str(run), "org/again", "--public"]) == 0
        assert main([str(tmp_path), "org/again"]) == 2  # no final/hf there
        assert main([str(run)]) == 2
    assert "pushed to the Hub: " in capsys.readouterr().out


def test_push_to_hub_must_be_a_repo_id(tmp_path):
    from rlhf.spec.errors import SpecError
    from tests.helpers import make_spec

    with pytest.raises(SpecError, match=r"checkpoint.push_to_hub='not a repo!' is not a Hub repo id"):
        make_spec(["checkpoint.push_to_hub='not a repo!'"], tmp_path / "r")
    assert make_spec(["checkpoint.push_to_hub=org/name"], tmp_path / "r2").checkpoint.push_to_hub == "org/name"

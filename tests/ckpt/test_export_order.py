"""The final export's order: every other dir first, ``final/hf`` last. Each dir is renamed into place
whole (rlhf.storage.publish), and ``final/hf`` being there is what resume= and the tracker take for
"the export is done": a PPO run killed between the two must not leave ``hf`` without ``critic_hf``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rlhf.ckpt import training
from rlhf.storage import publish
from tests.helpers import planned_spec


class _Group:
    def __init__(self, order: list):
        self.order = order

    def call(self, method, path):
        self.order.append(Path(path).name)
        with publish(Path(path)) as tmp:  # what save_hf does: write beside, rename
            (tmp / "config.json").write_text("{}")
        return [path]


def test_ppo_exports_the_critic_before_the_policy(tmp_path):
    order: list[str] = []
    cluster = SimpleNamespace(actor=_Group(order), critic=_Group(order))
    out = training.export_final(planned_spec(["algo=ppo"]), cluster, str(tmp_path))
    assert order == ["critic_hf", "hf"]
    assert out == str(tmp_path / "final" / "hf") and (tmp_path / "final" / "critic_hf" / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == ["critic_hf", "hf"]

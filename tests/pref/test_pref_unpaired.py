"""KTO's data: unpaired rows {prompt, response, label} and pairs split into one desirable and one
undesirable example, each example's mismatched completion, truncation, the batch, and the errors."""

from __future__ import annotations

import pytest

from rlhf.data.files import Records
from rlhf.data.preference import build_unpaired, collate_pairs, is_paired
from rlhf.spec.errors import UserError
from rlhf.spec.schema import DataSpec


def _data(**kw) -> DataSpec:
    return DataSpec(name="t", **kw)


ROWS = [
    {"prompt": "what is a", "response": "x y", "label": True},
    {"prompt": "what is b", "response": "z", "label": False},
    {"prompt": "what is c", "chosen": "x", "rejected": "y z"},
]


def test_rows_become_examples_with_mismatched_completions(keymap_tok):
    rec = Records(rows=[{"prompt": r["prompt"], "response": r.get("response", "a"), "label": r.get("label", True)}
                        for r in ROWS[:2]] + [ROWS[2]], source="t")
    out, report = build_unpaired(rec, keymap_tok, _data(), 20, seed=0)
    assert [e.desirable for e in out] == [True, False, True, False] and report.total == 4
    assert out[2].prompt == out[3].prompt  # a pair's two halves share the prompt
    completions = [e.completion for e in out]
    # every example's mismatched completion is another example's completion (a permutation's next)
    assert sorted(map(tuple, (e.kl_completion for e in out))) == sorted(map(tuple, completions))
    assert out == build_unpaired(rec, keymap_tok, _data(), 20, seed=0)[0]  # reproducible
    batch = collate_pairs(out, keymap_tok.pad_token_id)
    assert batch["desirable"].tolist() == [True, False, True, False]
    assert batch["response_tokens"].tolist() == [len(r) for e in out for r in e.responses()]


def test_truncation_keeps_the_mismatched_completion_within_max_length(keymap_tok):
    rec = Records(rows=[{"prompt": "what is a b c", "response": "x y z w v", "label": i % 2 == 0} for i in range(4)],
                  source="t")
    out, report = build_unpaired(rec, keymap_tok, _data(), 6, seed=1)
    assert report.truncated == 4
    assert all(len(e.prompt) + len(r) <= 6 for e in out for r in e.responses())


def test_is_paired_reads_the_keys():
    assert is_paired(Records(rows=[ROWS[2]], source="t"), _data())
    assert not is_paired(Records(rows=[ROWS[0]], source="t"), _data())


@pytest.mark.parametrize("row,match", [
    ({"prompt": "what is a", "response": "x", "label": "yes"}, r"'label' must be true \(a desirable completion\)"),
    ({"prompt": "what is a", "response": "x"}, "Set data.label_key"),
    ({"prompt": "what is a", "label": True}, "no key 'response'"),
])
def test_bad_rows_name_the_fix(keymap_tok, row, match):
    rec = Records(rows=[row, {"prompt": "what is b", "response": "y", "label": False}], source="t")
    with pytest.raises(UserError, match=match):
        build_unpaired(rec, keymap_tok, _data(), 20)


def test_one_example_is_too_few(keymap_tok):
    with pytest.raises(UserError, match="at least 2 examples"):
        build_unpaired(Records(rows=[ROWS[0]], source="t"), keymap_tok, _data(), 20)

"""load_tokenizer's short path for the built-in models (rlhf.models.load._builtin_tokenizer): the
same tokenizer AutoTokenizer builds, without importing transformers.models.auto in the driver; and
building a built-in model without transformers' optional imports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def _dir(name: str):
    from tests.helpers import make_spec

    from rlhf.models.builtin import builtin_model_dir

    spec = make_spec(["model=tiny-chat"] if name == "tiny-chat" else [], "/tmp/unused")
    return builtin_model_dir(name, spec.model)


@pytest.mark.parametrize("name", ["tiny", "tiny-chat"])
def test_a_builtin_tokenizer_is_the_one_autotokenizer_builds(rlhf_cache, name):
    from transformers import AutoTokenizer

    from rlhf.models.load import _builtin_tokenizer, load_tokenizer

    path = str(_dir(name))
    assert _builtin_tokenizer(path)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    assert (ours.pad_token, ours.eos_token, ours.bos_token) == (auto.pad_token, auto.eos_token, auto.bos_token)
    assert ours.chat_template == auto.chat_template and ours.init_kwargs == auto.init_kwargs
    texts = ["<bos> a b c", "hello world 12 + 3 =", "x " * 40]
    assert ours(texts)["input_ids"] == auto(texts)["input_ids"]
    chat = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)


def test_only_a_builtin_dir_takes_the_short_path(rlhf_cache, tmp_path):
    from rlhf.models.load import _builtin_tokenizer

    copy = tmp_path / _dir("tiny").name  # the same files elsewhere: a user's checkpoint, AutoTokenizer's
    shutil.copytree(_dir("tiny"), copy)
    assert not _builtin_tokenizer(str(copy))


def test_loading_a_builtin_tokenizer_imports_no_auto_classes(rlhf_cache):
    path = str(_dir("tiny"))
    heavy = ["transformers.models.auto.tokenization_auto", "transformers.models.auto.auto_factory", "torch._dynamo"]
    code = (f"HEAVY = {heavy!r}; import sys; from rlhf.models import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m in HEAVY))")
    from rlhf.launch.group import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]", out.stdout


def test_building_a_builtin_model_imports_neither_sklearn_nor_scipy(tmp_path):
    """A first run's driver builds builtin:tiny (``resolve_model_path``, as the preflight calls it):
    transformers' model classes would import scikit-learn and ``scipy.optimize`` when installed
    (1.5-5 s), for nothing any process of ours uses (``rlhf.models.load.skip_sklearn_and_scipy``)."""
    pytest.importorskip("sklearn")
    code = ("import sys, pathlib; from tests.helpers import make_spec; from rlhf.models import resolve_model_path; "
            "d = resolve_model_path('builtin:tiny', make_spec([], '/tmp/unused').model); "
            "assert (pathlib.Path(d) / 'config.json').exists(); "
            "print(sorted(m for m in sys.modules if m in ('sklearn', 'scipy.optimize')))")
    from rlhf.launch.group import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "RLHF_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout

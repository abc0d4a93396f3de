"""``rlhf-run --describe KEY``: a key's type, its value in this composition and its help text."""

from __future__ import annotations

from dataclasses import fields

from rlhf import cli
from rlhf.spec.schema import KLSpec


def test_describe_a_leaf_shows_type_value_from_the_overrides_and_help(capsys):
    assert cli.main(["--describe", "algo.kl.coef", "algo=ppo", "algo.kl.coef=0.07"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "algo.kl.coef: float = 0.07"
    assert "Weight beta of the KL term" in lines[1]
    assert all(not line.startswith("algo.kl.") for line in lines[1:])  # one key only


def test_describe_a_section_lists_every_field_with_this_compositions_values(capsys):
    assert cli.main(["algo=ppo", "--describe=algo.kl"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("algo.kl: KLSpec\n")
    keys = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  algo.kl.")]
    assert keys == [f"algo.kl.{f.name}" for f in fields(KLSpec)]
    assert "  algo.kl.estimator: str = 'k1'" in out  # ppo's group file, not the schema's k3
    assert "  algo.kl.placement: str = 'reward'" in out


def test_describe_a_null_section_shows_the_schemas_defaults(capsys):
    assert cli.main(["--describe", "algo.critic"]) == 0  # grpo: no critic
    out = capsys.readouterr().out
    assert out.startswith("algo.critic: Optional[CriticSpec] = null\n")
    assert "algo.critic.value_clip: float (default 0.2 once the section is set)" in out


def test_describe_an_unknown_key_names_the_nearest_keys_and_exits_2(capsys):
    assert cli.main(["--describe", "algo.kl.coeff"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "algo.kl.coeff" in err and "did you mean algo.kl.coef" in err


def test_describe_without_a_key_exits_2(capsys):
    assert cli.main(["--describe"]) == 2
    assert "--describe needs a key" in capsys.readouterr().err


def test_help_mentions_describe(capsys):
    assert cli.main(["--help"]) == 0
    assert "--describe KEY" in capsys.readouterr().out

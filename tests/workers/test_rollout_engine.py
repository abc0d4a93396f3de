"""The rollout engine interface (``rlhf.rollout.engine``) on the HF engine over the tiny model, in
this process: the per-request ``sample`` that a multi-turn agent drives, ``RequestBatcher``
(concurrent requests gathered into batched calls), stop tokens, and the engine registry's rules."""

from __future__ import annotations

import asyncio

import pytest

from rlhf.rollout.engine import RequestBatcher, RolloutEngine, Sampling


@pytest.fixture(scope="module")
def engine(rlhf_cache):
    from rlhf.models import load_model, load_tokenizer, resolve_model_path
    from rlhf.rollout.hf import HFEngine
    from tests.helpers import planned_spec

    spec = planned_spec([])
    path = resolve_model_path(spec.model.path, spec.model)
    tok = load_tokenizer(path)
    model = load_model(path, "causal_lm", "float32", pad_token_id=tok.pad_token_id)
    return HFEngine(model, tok.eos_token_id, tok.pad_token_id), tok


def _ids(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]


class _Counting:
    """The engine, counting its batched calls."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def generate(self, prompts, sampling):
        self.batches.append(len(prompts))
        return self.inner.generate(prompts, sampling)


def test_hf_engine_implements_the_interface(engine):
    assert isinstance(engine[0], RolloutEngine)


def test_one_request_is_sample_zero_of_its_prompt(engine):
    eng, tok = engine
    p = _ids(tok, "key k3")
    many = eng.generate([p], Sampling(n=4, max_new_tokens=6, seeds=(11,)))
    one = eng.sample(p, Sampling(max_new_tokens=6, seeds=(11,)))
    assert one.response_ids == many[0].response_ids
    assert one.logprobs == pytest.approx(many[0].logprobs, abs=1e-5)  # a batch of 4 rows sums in another order
    with pytest.raises(ValueError, match="sample\\(\\) draws one continuation"):
        eng.sample(p, Sampling(n=2, seeds=(11,)))


def test_concurrent_requests_are_batched_and_keep_their_seeds(engine):
    eng, tok = engine
    prompts = [_ids(tok, f"key k{i}") for i in range(3)]
    sp = [Sampling(max_new_tokens=5, seeds=(100 + i,)) for i in range(3)]
    alone = [eng.sample(p, s) for p, s in zip(prompts, sp)]
    counting = _Counting(eng)
    batcher = RequestBatcher(counting)

    async def main():
        return await asyncio.gather(*(batcher.sample(p, s) for p, s in zip(prompts, sp)))

    together = asyncio.run(main())
    assert counting.batches == [3]  # one batched call for the three requests
    assert [s.response_ids for s in together] == [s.response_ids for s in alone]
    for t, a in zip(together, alone):  # left padding changes the float sums' order, not the tokens
        assert t.logprobs == pytest.approx(a.logprobs, abs=1e-5)


def test_trajectories_advance_independently(engine):
    """Trajectory A takes two turns (its second prompt is its first turn plus feedback tokens),
    B one: the turns interleave as they come, and each equals what sampling it alone gives."""
    eng, tok = engine
    a0, b0 = _ids(tok, "key k1"), _ids(tok, "key k5")
    feedback = _ids(tok, "key k2")
    batcher = RequestBatcher(_Counting(eng))
    sp = lambda seed: Sampling(max_new_tokens=4, seeds=(seed,))  # noqa: E731

    async def traj_a():
        first = await batcher.sample(a0, sp(1))
        second = await batcher.sample(a0 + first.response_ids + feedback, sp(2))
        return first, second

    async def main():
        return await asyncio.gather(traj_a(), batcher.sample(b0, sp(3)))

    (first, second), b = asyncio.run(main())
    assert first.response_ids == eng.sample(a0, sp(1)).response_ids
    assert second.response_ids == eng.sample(a0 + first.response_ids + feedback, sp(2)).response_ids
    assert b.response_ids == eng.sample(b0, sp(3)).response_ids


def test_stop_token_ids_end_a_sample(engine):
    eng, tok = engine
    p = _ids(tok, "key k4")
    free = eng.sample(p, Sampling(max_new_tokens=6, seeds=(7,)))
    stop = free.response_ids[0]
    if stop == tok.eos_token_id:
        pytest.skip("the first token is EOS already")
    stopped = eng.sample(p, Sampling(max_new_tokens=6, seeds=(7,), stop_token_ids=(stop,)))
    assert stopped.response_ids == [stop] and stopped.finish_reason == "stop"


def test_registry_rules():
    from rlhf.rollout import registry
    from rlhf.rollout.hf_kind import HFKind

    assert registry.get("hf").name == "hf" and registry.get("vllm").device_weights
    assert registry.resolve("auto", "cuda") == "vllm" and registry.resolve("auto", "cpu") == "hf"

    class Again(HFKind):
        name = "hf"

    with pytest.raises(registry.RegistryError, match="registered twice"):
        registry.register_engine(Again)

    class Auto(HFKind):
        name = "auto"

    with pytest.raises(registry.RegistryError, match="needs a name other than 'auto'"):
        registry.register_engine(Auto)
    with pytest.raises(registry.RegistryError, match="rollout.engine='nope' is not valid"):
        registry.get("nope")

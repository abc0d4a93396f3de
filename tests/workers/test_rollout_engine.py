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


def test_draw_rows_is_torch_multinomial_row_by_row():
    """The batched race takes the very tokens ``torch.multinomial(probs[b], 1, generator=g_b)``
    takes, row by row over several tokens, with each row's draws made ahead (three tokens at once,
    or two then one) from its generator; full and truncated (top-k: zeros) distributions; rows
    left out keep their generator as it was."""
    import torch

    from rlhf.rollout.hf import draw_rows, exponential_noise

    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        B, V = 6, (22, 5, 300)[trial % 3]
        live = [b for b in range(B) if (b + trial) % 4]
        ref_gens = [torch.Generator().manual_seed(1000 * trial + b) for b in range(B)]
        gens = [torch.Generator().manual_seed(1000 * trial + b) for b in range(B)]
        chunks = (3,) if trial % 2 else (2, 1)
        noise = torch.cat([exponential_noise(gens, live, n, V) for n in chunks], dim=1)
        for step in range(3):
            probs = torch.softmax(torch.randn(B, V, generator=g) * 3, dim=-1)
            if (trial + step) % 2:
                probs = probs * (probs >= probs.topk(min(4, V), dim=-1).values[:, -1:])  # unnormalised, zeros
            want = [int(torch.multinomial(probs[b], 1, generator=ref_gens[b])[0]) if b in live else -1
                    for b in range(B)]
            assert draw_rows(probs, noise[:, step], live, -1).tolist() == want
        for b in range(B):
            assert torch.equal(gens[b].get_state(), ref_gens[b].get_state())
    assert draw_rows(probs, noise[:, 0], [], 7).tolist() == [7] * B


def test_draw_rows_rejects_what_multinomial_rejects():
    import torch

    from rlhf.rollout.hf import draw_rows

    noise = torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="nan"):
        draw_rows(torch.tensor([[0.5, 0.5], [float("nan"), 1.0]]), noise, [0, 1], 0)
    with pytest.raises(RuntimeError, match="sum of probabilities"):
        draw_rows(torch.tensor([[0.5, 0.5], [0.0, 0.0]]), noise, [0, 1], 0)
    assert draw_rows(torch.tensor([[0.0, 1.0], [float("nan"), 1.0]]), noise, [0], 5).tolist() == [1, 5]


@pytest.mark.parametrize("max_batch", [256, 4])
def test_generate_equals_a_row_by_row_sampler(engine, max_batch):
    """The engine's batched loop against the plain one: each row on its own generator through
    ``torch.multinomial``, token by token, every row prefilled on its own (the engine prefills a
    prompt once for its samples; ``max_batch=4`` cuts a prompt's samples over two calls)."""
    import torch

    from rlhf.rollout.hf import HFEngine

    eng, tok = engine
    model = eng.model
    eng = HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=max_batch)
    rows_per_call = []
    eng.model = lambda **kw: rows_per_call.append(kw["input_ids"].shape) or model(**kw)
    prompts = [_ids(tok, text) for text in ("key k1", "key k2 k3 k4", "key")]
    sp = Sampling(n=3, max_new_tokens=6, temperature=0.8, top_k=6, seeds=(5, 6, 7), stop_token_ids=(4,))
    got = eng.generate(prompts, sp)
    # the prefills: one row per prompt of the call (a call of 4 rows holds 2 prompts, then 2, then 1)
    assert [n for n, width in rows_per_call if width > 1] == ([3] if max_batch == 256 else [2, 2, 1])
    rows = [(i, j) for i in range(len(prompts)) for j in range(sp.n)]
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (P - len(prompts[i])) + prompts[i] for i, _ in rows])
    attn = torch.tensor([[0] * (P - len(prompts[i])) + [1] * len(prompts[i]) for i, _ in rows])
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    gens = [torch.Generator().manual_seed(sp.seeds[i] * 1_000_003 + j) for i, j in rows]
    want = [([], []) for _ in rows]
    done = [False] * len(rows)
    past, step_ids, step_pos = None, ids, pos
    with torch.no_grad():
        for _ in range(sp.max_new_tokens):
            out = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos, past_key_values=past,
                            use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float() / sp.temperature
            kth = logits.topk(sp.top_k, dim=-1).values[:, -1:]
            probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
            logp = torch.log_softmax(logits, dim=-1)  # before the top-k cut (rlhf.rollout.engine)
            nxt = []
            for b in range(len(rows)):
                t = tok.pad_token_id if done[b] else int(torch.multinomial(probs[b], 1, generator=gens[b]))
                if not done[b]:
                    want[b][0].append(t)
                    want[b][1].append(float(logp[b, t]))
                    done[b] = t in (tok.eos_token_id, 4)
                nxt.append(t)
            if all(done):
                break
            step_ids, step_pos = torch.tensor(nxt).unsqueeze(1), step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones(len(rows), 1, dtype=attn.dtype)], dim=1)
    assert [s.response_ids for s in got] == [r for r, _ in want]
    for s, (_, lp) in zip(got, want):  # a prefill of fewer rows may sum in another order
        assert s.logprobs == pytest.approx(lp, abs=1e-5)
    assert [s.prompt_index for s in got] == [i for i, _ in rows]
    assert [s.finish_reason for s in got] == ["stop" if r and r[-1] in (tok.eos_token_id, 4) else "length"
                                             for r, _ in want]


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

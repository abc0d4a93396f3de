"""The vLLM engine wrapper against a stand-in ``vllm`` module (CPU): argument plumbing, sample
order, logprob extraction, seeds, sleep bookkeeping and the worker extension's loading path."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest
import torch


@dataclass
class _Logprob:
    logprob: float
    rank: int = 1


@dataclass
class _Completion:
    index: int
    token_ids: list
    logprobs: list
    finish_reason: str


@dataclass
class _Flat:
    """vLLM's FlatLogprobs columns: position i's entries are [start_indices[i], end_indices[i])."""
    start_indices: list = field(default_factory=list)
    end_indices: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)


@dataclass
class _Output:
    outputs: list


class _FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3, 2))
        self.b = torch.nn.Parameter(torch.zeros(2))

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
        return {n for n, _ in weights}


class _FakeLLM:
    instances: list = []

    def __init__(self, **kw):
        from rlhf.rollout.vllm_ext import WeightSyncExtension

        self.kw = kw
        self.calls = []
        worker_cls = type("W", (WeightSyncExtension,), {})
        self.worker = worker_cls()
        self.worker.model_runner = types.SimpleNamespace(model=_FakeModel())
        self.worker.device = torch.device("cpu")
        _FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append((prompts, params))
        outs = []
        for i, p in enumerate(prompts):
            sp = params[i] if isinstance(params, list) else params
            comps = []
            for j in reversed(range(sp.n)):  # out of order on purpose
                base = (sp.seed or 0) + j
                ids = [(base + k + len(p["prompt_token_ids"])) % 50 for k in range(sp.max_tokens)]
                if getattr(sp, "flat_logprobs", False):
                    lps = _Flat(list(range(len(ids))), list(range(1, len(ids) + 1)), list(ids),
                                [-0.1 * (k + 1) for k in range(len(ids))])
                else:
                    lps = [{t: _Logprob(-0.1 * (k + 1))} for k, t in enumerate(ids)]
                comps.append(_Completion(j, ids, lps, "length"))
            outs.append(_Output(comps))
        return outs

    def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def sleep(self, level=1):
        self.slept = level

    def wake_up(self, tags=None):
        self.woke = tags

    def reset_prefix_cache(self):
        self.reset = True


class _SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM = _FakeLLM
    mod.SamplingParams = _SamplingParams
    mod.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", mod)
    import rlhf.rollout.vllm as rv

    monkeypatch.setattr(rv, "_free_total", lambda: (100 << 30, 141 << 30))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    _FakeLLM.instances.clear()
    return rv


def test_engine_settings_and_generation(fake_vllm, monkeypatch):
    rv = fake_vllm
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    eng = rv.VLLMEngine(rv.EngineConfig(model_path="/m", gpu_memory_utilization=0.3, max_model_len=256,
                                        eos_token_id=2))
    kw = _FakeLLM.instances[-1].kw
    assert kw["skip_tokenizer_init"] and kw["enable_sleep_mode"]
    assert kw["worker_extension_cls"] == "rlhf.rollout.vllm_ext.WeightSyncExtension"
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["max_model_len"] == 256 and kw["gpu_memory_utilization"] == 0.3
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"

    from rlhf.rollout.engine import Sample, Sampling

    out = eng.generate([[1, 2, 3], [4, 5]], Sampling(n=3, max_new_tokens=4, temperature=0.7, seeds=(10, 20)))
    assert all(isinstance(s, Sample) for s in out)
    assert [s.prompt_index for s in out] == [0, 0, 0, 1, 1, 1]
    # samples come back in child order, with their seeds
    assert out[0].response_ids[0] == (10 + 0 + 3) % 50 and out[1].response_ids[0] == (10 + 1 + 3) % 50
    assert out[0].logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    _, params = _FakeLLM.instances[-1].calls[-1]
    assert [p.seed for p in params] == [10, 20]
    assert params[0].stop_token_ids == [2] and params[0].logprobs == 0 and params[0].detokenize is False
    assert params[0].flat_logprobs is True  # the default: no Logprob object per token on the host
    assert params[0].temperature == pytest.approx(0.7)

    packed = eng.generate_packed([[1, 2]], n=2, max_tokens=3, ignore_eos=True)
    assert packed["lengths"].tolist() == [3, 3] and packed["token_ids"].shape == (6,)
    _, p2 = _FakeLLM.instances[-1].calls[-1]
    assert p2.ignore_eos and p2.stop_token_ids is None


def test_nested_logprobs_give_the_same_samples(fake_vllm):
    rv = fake_vllm
    flat = rv.VLLMEngine(rv.EngineConfig(model_path="/m")).generate_ids([[1, 2], [3]], n=2, max_tokens=5)
    nested = rv.VLLMEngine(rv.EngineConfig(model_path="/m", flat_logprobs=False)).generate_ids(
        [[1, 2], [3]], n=2, max_tokens=5)
    assert _FakeLLM.instances[-1].calls[-1][1].flat_logprobs is False
    assert [(s.response_ids, s.logprobs) for s in flat] == [(s.response_ids, s.logprobs) for s in nested]
    assert nested[0].logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    off = rv.VLLMEngine(rv.EngineConfig(model_path="/m")).generate_ids([[1]], max_tokens=3, logprobs=False)
    assert off[0].logprobs == [] and _FakeLLM.instances[-1].calls[-1][1].flat_logprobs is False


def test_sampled_logprobs_from_flat_columns_with_candidates():
    from rlhf.rollout.vllm import _sampled_logprobs

    # top-2 candidates per position, the sampled token not always first (logprobs=k > 0)
    lp = _Flat([0, 2, 4], [2, 4, 6], [7, 8, 9, 3, 5, 6], [-0.5, -1.0, -2.0, -0.25, -0.75, -3.0])
    assert _sampled_logprobs(lp, [7, 3, 6]) == [-0.5, -0.25, -3.0]
    # one entry per position (logprobs=0): the column itself
    assert _sampled_logprobs(_Flat([0, 1], [1, 2], [4, 5], [-1.5, -2.5]), [4, 5]) == [-1.5, -2.5]
    nested = [{7: _Logprob(-0.5), 8: _Logprob(-1.0)}, {9: _Logprob(-2.0), 3: _Logprob(-0.25)}]
    assert _sampled_logprobs(nested, [7, 3]) == [-0.5, -0.25]
    assert _sampled_logprobs(None, [1]) == []


def test_sleep_wake_and_weight_loading(fake_vllm):
    rv = fake_vllm
    eng = rv.VLLMEngine(rv.EngineConfig(model_path="/m"))
    mem = eng.sleep(level=2)
    assert _FakeLLM.instances[-1].slept == 2 and "memory/vllm_freed_fraction" in mem
    with pytest.raises(RuntimeError):
        eng.generate_ids([[1]], max_tokens=2)
    eng.wake_up(["weights"])
    assert eng.asleep  # the KV cache is still asleep
    eng.wake_up(["kv_cache"])
    assert not eng.asleep

    eng.load_weights({"w": torch.ones(3, 2), "b": torch.full((2,), 2.0)})
    model = _FakeLLM.instances[-1].worker.model_runner.model
    assert torch.equal(model.w, torch.ones(3, 2)) and torch.equal(model.b, torch.full((2,), 2.0))
    d = eng.weight_digest()
    assert d["numel"] == 8 and d["sum"] == pytest.approx(10.0) and d["sumsq"] == pytest.approx(14.0)


def test_logprob_mismatch_stats():
    from rlhf.algos.kl import logprob_mismatch

    roll = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mine = torch.tensor([[-1.1, -2.0, 5.0], [-0.3, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = logprob_mismatch(roll, mine, mask)
    assert m["mismatch/logp_abs_mean"] == pytest.approx((0.1 + 0.0 + 0.2) / 3)
    assert m["mismatch/logp_abs_max"] == pytest.approx(0.2)
    assert m["mismatch/kl_k3"] >= 0

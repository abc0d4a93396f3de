"""model.compile_layers on CPU (rlhf.models.compiled): every decoder layer torch.compile'd, here with
the aot_eager backend (dynamo's and AOTAutograd's tracing as on the GPU, no generated code: inductor's
C++ build would take minutes on this machine). The compiled packed pass gives the eager pass's
log-probs and gradients; one graph serves the layers; a compilation that fails warns once and the
layers run eagerly with the same results; the model workers apply it when the spec says so."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from rlhf.data.batch import collate
from rlhf.data.packing import pack, unpack
from rlhf.models.compiled import compile_layers, compiled, decoder_layers
from rlhf.models.varlen import packed_kwargs, use_varlen


def _tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg)
    use_varlen(model)
    return model


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(1, 8, (5,), generator=g)]
    responses = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (5,), generator=g)]
    return collate(prompts, responses, pad_id=0, response_width=8)


def _logprobs(model, b):
    """Packed pass: float64 log-probs of the response tokens, back in the padded layout [5, 8]."""
    p = pack(b, list(range(5)))
    h = model.model(**packed_kwargs(p, "cpu")).last_hidden_state[0][p["pred_index"]]
    lp = torch.log_softmax(model.lm_head(h).double(), -1).gather(1, p["targets"][:, None]).squeeze(1)
    return unpack(lp, p, 5, 8)


@pytest.fixture(scope="module")
def pair():
    eager = _tiny_qwen2()
    comp = copy.deepcopy(eager)
    from torch._dynamo.utils import counters

    counters.clear()
    assert compile_layers(comp, backend="aot_eager") == 3
    return eager, comp, counters


def test_compiled_layers_give_the_eager_logprobs_and_gradients(pair):
    eager, comp, counters = pair
    for seed in (1, 2):  # two packed lengths: dynamic shapes, no recompile per length needed
        b = _batch(seed)
        for m in (eager, comp):
            m.zero_grad()
        ref, got = _logprobs(eager, b), _logprobs(comp, b)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=ref.dtype)
        (ref * g).sum().backward()
        (got * g).sum().backward()
        for (name, p), q in zip(comp.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # the frozen roles' pass (no grad, eval)
        comp.eval(), eager.eval()
        torch.testing.assert_close(_logprobs(comp, _batch(3)), _logprobs(eager, _batch(3)), rtol=0, atol=1e-5)
        comp.train(), eager.train()
    assert compiled(comp)
    # one traced graph per mode serves the three layers (train with grad, no-grad eval), not one per layer
    # (3 layers, 2 packed lengths: one graph per layer or per length would make more)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # the parameters and their names are the model's own (DeepSpeed, weight sync and checkpoints)
    assert [n for n, _ in comp.named_parameters()] == [n for n, _ in eager.named_parameters()]


def test_a_failed_compilation_warns_once_and_runs_eagerly():
    eager = _tiny_qwen2(seed=4)
    comp = copy.deepcopy(eager)

    def failing_backend(gm, example_inputs):
        raise RuntimeError("no code generator here")

    compile_layers(comp, backend=failing_backend)
    b = _batch(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _logprobs(comp, b)
        again = _logprobs(comp, b)
    mine = [w for w in caught if "model.compile_layers" in str(w.message)]
    assert len(mine) == 1 and "running them eagerly" in str(mine[0].message)
    assert not compiled(comp)
    ref = _logprobs(eager, b)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(again, ref, rtol=0, atol=1e-12)


def test_layers_are_found_in_the_model_kinds_the_workers_load():
    from transformers import Qwen2Config, Qwen2ForSequenceClassification, Qwen2ForTokenClassification

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1)
    for cls in (Qwen2ForTokenClassification, Qwen2ForSequenceClassification):  # critic, reward model
        assert len(decoder_layers(cls(cfg))) == 2
    with pytest.warns(UserWarning, match="no decoder layers found"):
        assert compile_layers(torch.nn.Linear(2, 2)) == 0


def test_the_model_workers_compile_when_the_spec_says_so():
    from rlhf.workers.frozen import ReferenceWorker
    from tests.helpers import planned_spec

    for value, expect in (("true", True), ("auto", False)):
        spec = planned_spec([f"model.compile_layers={value}"])
        assert spec.model.compile_layers is expect and spec.model.liger_kernels is False
        w = object.__new__(ReferenceWorker)  # no __init__: only what load reads
        w.spec, w.device = spec, "cpu"
        model = w.load()
        assert compiled(model) is expect

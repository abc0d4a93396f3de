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


def _fails_in_backward():
    """A backend whose forward compiles and whose backward compiler raises: the failure a model's first
    ``backward()`` would meet inside autograd, where no layer call can catch it."""
    from torch._dynamo.backends.common import aot_autograd

    def bw(gm, example_inputs):
        raise RuntimeError("no code generator for this backward")

    return aot_autograd(fw_compiler=lambda gm, example_inputs: gm, bw_compiler=bw)


def _train_pass(model, seed: int):
    model.zero_grad()
    lp = _logprobs(model, _batch(seed))
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_warm_up_builds_the_training_graphs_on_a_copy_and_leaves_the_model_alone():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the graphs of the tests above would be found instead of built
    eager = _tiny_qwen2(seed=6)
    comp = copy.deepcopy(eager)
    compile_layers(comp, backend="aot_eager")
    before = [p.detach().clone() for p in comp.parameters()]
    rng = torch.get_rng_state()
    counters.clear()
    from rlhf.models.compiled import warm_up

    assert warm_up(comp, torch.device("cpu"), torch.float32, "aot_eager") is True
    built = counters["stats"]["unique_graphs"]
    assert built >= 1  # the forward graph was traced now, before any real pass
    assert compiled(comp) and torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in comp.parameters())  # the copy's gradients stay in the copy
    assert all(torch.equal(a, b) for a, b in zip(before, comp.parameters()))
    ref, ref_g = _train_pass(eager, 7)
    got, got_g = _train_pass(comp, 7)  # the real layers find the warm-up's graphs
    assert counters["stats"]["unique_graphs"] == built, dict(counters["stats"])
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_backward_that_fails_to_compile_is_caught_by_the_warm_up():
    from rlhf.models.compiled import warm_up

    torch._dynamo.reset()
    eager = _tiny_qwen2(seed=8)
    # without the warm-up the failure surfaces inside backward() and ends the pass
    bare_model = copy.deepcopy(eager)
    compile_layers(bare_model, backend=_fails_in_backward())
    with pytest.raises(Exception, match="no code generator for this backward"):
        _train_pass(bare_model, 9)

    torch._dynamo.reset()
    comp = copy.deepcopy(eager)
    compile_layers(comp, backend=_fails_in_backward())
    with pytest.warns(UserWarning, match="failed before training .*running them eagerly"):
        assert warm_up(comp, torch.device("cpu"), torch.float32, _fails_in_backward()) is False
    assert not compiled(comp)
    ref, ref_g = _train_pass(eager, 9)
    got, got_g = _train_pass(comp, 9)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert ref_g.keys() == got_g.keys() and all(torch.equal(got_g[n], ref_g[n]) for n in ref_g)


def test_warm_up_leaves_a_model_it_cannot_copy_as_it_is():
    from rlhf.models.compiled import warm_up

    comp = _tiny_qwen2(seed=10)
    compile_layers(comp, backend="aot_eager")
    comp.model.register_parameter("stray", torch.nn.Parameter(torch.zeros(1)))  # outside any sub-module
    assert warm_up(comp, torch.device("cpu"), torch.float32, "aot_eager") is True and compiled(comp)
    assert warm_up(torch.nn.Linear(2, 2), torch.device("cpu"), torch.float32) is False  # no layers: nothing compiled


def test_the_trained_roles_warm_up_before_deepspeed_wraps_the_model(monkeypatch):
    import deepspeed

    from rlhf.models import compiled as compiled_mod
    from rlhf.workers.policy import PolicyWorker
    from tests.helpers import planned_spec

    order = []
    monkeypatch.setattr(compiled_mod, "warm_up", lambda model, device, dtype, backend: order.append(
        ("warm_up", str(device), dtype, backend)))

    class Stop(Exception):
        pass

    def initialize(**kw):
        order.append("deepspeed")
        raise Stop

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    for value, expect in (("true", [("warm_up", "cpu", torch.float32, "aot_eager"), "deepspeed"]),
                          ("false", ["deepspeed"])):
        order.clear()
        w = object.__new__(PolicyWorker)  # no __init__: only what _initialize reads
        w.spec, w.device, w.world_size = planned_spec([f"model.compile_layers={value}"]), "cpu", 1
        model = torch.nn.Linear(2, 2)
        with pytest.raises(Stop):
            w._initialize(model, list(model.parameters()), 1e-6, 0)
        assert order == expect


def test_graphs_compiled_counts_a_recompile_when_a_pass_fails_the_guards():
    """rlhf.models.compiled.graphs_compiled: what the actor's update reports as perf/compiled_graphs.
    A pass of a shape class already compiled adds nothing; a packed micro-batch of one sample fails the
    guards of the graph traced on several (its one-element lengths specialize, on this CPU path) and
    is traced again: +1, then nothing the second time."""
    import torch._dynamo

    from rlhf.models.compiled import graphs_compiled

    torch._dynamo.reset()  # an earlier test's graphs of the same layer code would serve the first pass
    model = _tiny_qwen2(seed=6)
    compile_layers(model, backend="aot_eager")

    def packed_pass(lengths: list[int]) -> None:
        g = torch.Generator().manual_seed(sum(lengths))
        prompts = [torch.randint(1, 64, (3,), generator=g).tolist() for _ in lengths]
        responses = [torch.randint(1, 64, (n,), generator=g).tolist() for n in lengths]
        p = pack(collate(prompts, responses, pad_id=0, response_width=8), list(range(len(lengths))))
        model.model(**packed_kwargs(p, "cpu")).last_hidden_state.square().mean().backward()

    start = graphs_compiled()
    packed_pass([5, 7, 4])
    first = graphs_compiled()
    assert first > start
    packed_pass([8, 3])  # another length, same class: dynamic shapes, no new graph
    assert graphs_compiled() == first
    packed_pass([6])
    assert graphs_compiled() == first + 1
    packed_pass([4])
    assert graphs_compiled() == first + 1

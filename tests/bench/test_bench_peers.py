"""bench.e2e_peers on CPU: the flash_attn stand-in the peers run on (against float64 attention
written out here), the parsers of veRL's and OpenRLHF's step logs (OpenRLHF's line is the one its
0.11.2 printed on the H200, BENCHMARKS.md §8), the side-by-side table and each side's settings."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from bench import e2e_peers

SHIM = Path(e2e_peers.__file__).parent / "peers" / "shim" / "flash_attn"


def _load(name: str, path: Path):
    """The stand-in's modules by file, under private names: never on sys.path as ``flash_attn`` here,
    so no other test sees a flash-attn distribution."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fa():
    return _load("_bench_fa_standin", SHIM / "__init__.py")


@pytest.fixture(scope="module")
def bp():
    return _load("_bench_fa_standin_bert_padding", SHIM / "bert_padding.py")


def _attention_f64(q, k, v, lens, causal):
    """softmax(q·kᵀ/√d)·v per sample and head, keys of the same sample only (causal: s ≤ t),
    kv head h // (Hq / Hkv) for query head h; one query at a time, float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    groups = q.shape[1] // k.shape[1]
    start = 0
    for n in lens:
        for t in range(n):
            for h in range(q.shape[1]):
                last = start + (t + 1 if causal else n)
                keys = k[start:last, h // groups].double()
                w = torch.softmax(keys @ q[start + t, h].double() / math.sqrt(q.shape[-1]), dim=0)
                out[start + t, h] = w @ v[start:last, h // groups].double()
        start += n
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_standin_matches_float64_attention(fa, causal):
    g = torch.Generator().manual_seed(7 + causal)
    lens = [5, 1, 9, 3]
    total, hq, hkv, d = sum(lens), 4, 2, 8
    q, k, v = (torch.randn(total, h, d, generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    ref = _attention_f64(q, k, v, lens, causal)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_dense_standin_is_the_varlen_of_equal_rows(fa):
    g = torch.Generator().manual_seed(3)
    b, s, hq, hkv, d = 3, 6, 4, 1, 8
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    ref = _attention_f64(q.reshape(b * s, hq, d), k.reshape(b * s, hkv, d), v.reshape(b * s, hkv, d), [s] * b, True)
    out = fa.flash_attn_func(q, k, v, causal=True)
    assert ((out.reshape(b * s, hq, d).double() - ref).norm() / ref.norm()).item() < 1e-5


def test_unpad_then_pad_restores_the_real_tokens(bp):
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    h = torch.randn(3, 4, 5, generator=g)
    flat, idx, cu, longest, used = bp.unpad_input(h, mask)
    assert flat.shape == (9, 5) and cu.tolist() == [0, 3, 5, 9] and longest == 4 and used.tolist() == [3, 2, 4]
    back = bp.pad_input(flat, idx, 3, 4)
    assert torch.equal(back[mask.bool()], h[mask.bool()])
    assert not back[~mask.bool()].any()


ORL_LINE = (
    "\x1b[36m(PPOTrainer pid=3348)\x1b[0m INFO 12-02 01:25:54 ppo_trainer.py:551] ✨ Global step 1: {'kl': 0.0, "
    "'truncated': 0.99609375, 'policy_loss': 0.00018001299350202653, 'response_length': 255.8828125, "
    "'actor_lr': 1e-06, 'logprobs_diff': 0.0, 'timing/make_experience': 1.3090276718139648, "
    "'timing/ppo_train': 2.897165536880493, 'timing/broadcast': 1.8197953701019287, "
    "'rollout/reward_mean': 0.06918304413557053, 'rollout/response_length_mean': 255.8828125, "
    "'rollout/truncated_rate': 0.99609375, 'rollout/num_samples': 256.0, "
    "'timing/generation': 3.437248706817627, 'timing/step_total': 9.463237285614014}"
)


def test_openrlhf_step_line_parses_into_phases(tmp_path):
    log = tmp_path / "openrlhf.log"
    log.write_text("noise\n" + ORL_LINE + "\n")
    (s,) = e2e_peers.openrlhf_steps(log, samples=256)
    assert s["step"] == 1 and s["step_s"] == pytest.approx(9.463237285614014)
    assert (s["generate"], s["logp"], s["update"], s["sync"]) == pytest.approx((3.4372487, 1.3090277, 2.8971655, 1.8197954))
    # OpenRLHF's step_total is the sum of its four timers: nothing is left for "other"
    assert s["other"] == pytest.approx(0.0, abs=1e-6)
    assert s["tokens"] == pytest.approx(255.8828125 * 256) and s["truncated"] == pytest.approx(0.99609375)


def test_verl_step_line_parses_into_phases(tmp_path):
    line = ("(TaskRunnerV1 pid=9) step:2 - actor/pg_loss:0.01 - timing_s/gen:2.5 - timing_s/reward:0.1 - "
            "timing_s/old_log_prob:0.4 - timing_s/ref:0.3 - timing_s/adv:0.05 - timing_s/update_actor:1.5 - "
            "timing_s/update_weights:0.6 - timing_s/step:5.7 - response_length/mean:250.0 - "
            "response_length/clip_ratio:0.9")
    log = tmp_path / "verl.log"
    log.write_text("step:1 - no timing here\n" + line + "\n")
    (s,) = e2e_peers.verl_steps(log, samples=256)
    assert s["step"] == 2 and s["step_s"] == 5.7
    assert (s["generate"], s["reward"], s["logp"], s["update"], s["sync"]) == pytest.approx((2.5, 0.1, 0.7, 1.5, 0.6))
    assert s["other"] == pytest.approx(5.7 - 5.4) and s["tokens"] == 250.0 * 256
    assert (s["old_logp_s"], s["reference_s"]) == (0.4, 0.3)


def test_report_gives_each_peer_its_ratio_to_ours():
    a = e2e_peers.parse_args(["--sides", "openrlhf,ours", "--warmup", "0", "--steps", "1"])
    row = dict(generate=1.0, sync=0.1, reward=0.0, logp=0.2, update=0.5, other=0.2, step_s=2.0,
               tokens=100.0, mean_len=10.0, truncated=0.0)
    call = {"id": "1-2", "host": "h", "boot": "b"}
    res = {"ours": {"status": "ok, 1 steps", "summary": e2e_peers.base.summarize([row], 0), "call": call},
           "openrlhf": {"status": "ok, 1 steps", "call": call,
                        "summary": e2e_peers.base.summarize([dict(row, step_s=3.0, generate=2.0)], 0)}}
    out = e2e_peers.report(a, res)
    assert "| **step** | 3.00 | 2.00 |" in out
    assert out.startswith("e2e GRPO step, side by side on one GPU:")
    assert "speed-up vs OpenRLHF (its step / ours, mean): 1.50 (goal >= 1.3: met)" in out

    # sides kept from separate calls (or saved before calls were recorded) are not passed off as one run
    res["openrlhf"]["call"] = dict(call, id="3-4")
    out = e2e_peers.report(a, res)
    assert out.startswith("e2e GRPO step, from 2 separate calls (not one run):")
    assert "1.50 (goal >= 1.3: met; across calls, not a one-run ratio)" in out
    del res["openrlhf"]["call"], res["ours"]["call"]
    assert "from 2 separate calls" in e2e_peers.report(a, res)


def test_report_names_each_of_our_updates_and_the_graphs_it_compiled():
    """Our metrics' perf/compiled_graphs reaches the report beside each step's update (every step,
    warm-ups too): a slow update with compiles in it paid for a recompile. The peers report none."""
    a = e2e_peers.parse_args(["--sides", "ours,openrlhf", "--warmup", "1", "--steps", "2"])
    metrics = [{"step": i + 1, "time/step": t, "time/update": u, "perf/compiled_graphs": g, "time/generate": 1.0}
               for i, (t, u, g) in enumerate([(9.0, 5.0, 12.0), (4.0, 1.0, 0.0), (8.0, 5.0, 2.0)])]
    ours = [e2e_peers.base.ours_step(r, samples=8) for r in metrics]
    peer = [dict(ours[0], compiled_graphs=None, update=1.0)] * 3
    res = {s: {"status": "ok, 3 steps", "summary": e2e_peers.base.summarize(rows, 1)}
           for s, rows in (("ours", ours), ("openrlhf", [{k: v for k, v in r.items() if k != "compiled_graphs"}
                                                          for r in peer]))}
    out = e2e_peers.report(a, res)
    assert "(timed); updates [5.0, 1.0, 5.0] s, graphs compiled [12, 0, 2]" in out
    assert [line for line in out.splitlines() if line.startswith("OpenRLHF:")][0].endswith("(timed)")


def test_peer_tokens_set_the_peers_budget_apart_from_ours(tmp_path):
    a = e2e_peers.parse_args(["--ours-tokens", "32768", "--peer-tokens", "16384"])
    lines = dict(line.split(": ", 1) for line in e2e_peers.settings_lines(a, "/m", "/p.jsonl", tmp_path))
    assert "train.max_tokens_per_micro_batch=32768" in lines["ours"]
    assert "--train.max_tokens_per_gpu 16384 --rollout.max_tokens_per_gpu 16384" in lines["openrlhf"]
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384" in lines["verl"]
    assert e2e_peers.micro_batch(a, "openrlhf") == e2e_peers.micro_batch(a, "verl") == "<= 16384 tokens"
    b = e2e_peers.parse_args([])  # default: the peers get our budget
    assert e2e_peers.peer_tokens(b) == b.ours_tokens == 32768


def test_a_report_over_separate_calls_prints_each_sides_own_micro_batch():
    """OpenRLHF ran at --peer-tokens 16384 in its own call, veRL and ours at 32768 in theirs: the
    --report call (no --peer-tokens) must print what each side ran with, not its own arguments."""
    ran = {"ours": e2e_peers.parse_args([]), "verl": e2e_peers.parse_args([]),
           "openrlhf": e2e_peers.parse_args(["--peer-tokens", "16384"])}
    row = dict(generate=1.0, sync=0.1, reward=0.0, logp=0.2, update=0.5, other=0.2, step_s=2.0,
               tokens=100.0, mean_len=10.0, truncated=0.0)
    res = {s: {"status": "ok", "summary": e2e_peers.base.summarize([row], 0), "call": {"id": s},
               "micro_batch": e2e_peers.micro_batch(args, s)} for s, args in ran.items()}
    out = e2e_peers.report(e2e_peers.parse_args(["--sides", "ours,verl,openrlhf"]), res)
    assert "micro-batches: ours <= 32768 tokens, veRL <= 32768 tokens, OpenRLHF <= 16384 tokens;" in out, out
    assert e2e_peers.micro_batch(e2e_peers.parse_args([]), "trl").endswith(" samples")
    zero = e2e_peers.parse_args(["--ours-tokens", "0", "--peer-tokens", "16384"])
    assert e2e_peers.micro_batch(zero, "ours") == "the plan's token budget"
    # a side file saved before sides recorded their budget: the reporting call's arguments for it
    del res["verl"]["micro_batch"]
    out = e2e_peers.report(e2e_peers.parse_args(["--sides", "ours,verl", "--peer-tokens", "8192"]), res)
    assert "micro-batches: ours <= 32768 tokens, veRL <= 8192 tokens;" in out, out


def test_negative_peer_tokens_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        e2e_peers.parse_args(["--peer-tokens", "-5"])
    assert e.value.code != 0
    assert "--peer-tokens -5: give a token budget > 0, or 0 for --ours-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the plan's budget for ours leaves the peers none to copy
        e2e_peers.parse_args(["--ours-tokens", "0"])
    assert "--ours-tokens 0 leaves the peers no token budget: give --peer-tokens N" in capsys.readouterr().err
    assert e2e_peers.parse_args(["--ours-tokens", "0", "--peer-batching", "samples"]).ours_tokens == 0
    assert e2e_peers.parse_args(["--ours-tokens", "0", "--sides", "ours"]).ours_tokens == 0  # no peer to budget


def test_each_side_gets_the_same_workload(tmp_path):
    a = e2e_peers.parse_args(["--kl", "0.001", "--max-new", "512"])
    lines = dict(line.split(": ", 1) for line in e2e_peers.settings_lines(a, "/m", "/p.jsonl", tmp_path))
    assert set(lines) == {"verl", "openrlhf", "ours", "trl"}
    v, o = lines["verl"], lines["openrlhf"]
    for want in ("data.train_batch_size=32", "actor_rollout_ref.rollout.n=8", "data.max_response_length=512",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=32", "loss_agg_mode=token-mean",
                 "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=k3",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768"):
        assert want in v, want
    for want in ("--rollout.batch_size 32", "--rollout.n_samples_per_prompt 8", "--train.batch_size 256",
                 "--rollout.max_new_tokens 512", "--actor.loss_agg_mode token-mean", "--algo.kl.init_coef 0.001",
                 "--algo.kl.estimator k3", "--train.max_tokens_per_gpu 32768", "--ds.zero_stage 2",
                 "--vllm.enable_prefix_caching", "--ds.use_liger_kernel"):
        assert want in o, want
    assert "algo.kl.coef=0.001" in lines["ours"] and "rollout.max_response_tokens=512" in lines["ours"]
    assert "beta=0.001" in lines["trl"] and "max_completion_length=512" in lines["trl"]


def test_verl_gets_the_fused_head_and_a_tokenizer_as_wide_as_the_model(tmp_path):
    from transformers import AutoTokenizer

    from bench.common import build_tokenizer

    a = e2e_peers.parse_args([])
    v = dict(line.split(": ", 1) for line in e2e_peers.settings_lines(a, "/m", "/p.jsonl", tmp_path))["verl"]
    assert "actor_rollout_ref.model.use_fused_kernels=true" in v
    assert f"actor_rollout_ref.model.tokenizer_path={tmp_path / 'verl_tokenizer'}" in v
    assert "use_fused_kernels=false" in e2e_peers.settings_lines(
        e2e_peers.parse_args(["--sides", "verl", "--verl-fused", "false"]), "/m", "/p", tmp_path)[0]

    # a small model dir: a config of 700 rows and the bench's own (smaller) tokenizer
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2", "vocab_size": 700}')
    small = build_tokenizer()
    small.save_pretrained(model)
    assert len(small) < 700
    out = e2e_peers.padded_tokenizer(str(model), tmp_path / "tok")
    wide, plain = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(model)  # as the sides load them
    assert len(wide) == 700 and len(plain) == len(small)  # veRL's vLLM mask (from len(tokenizer) up) covers nothing
    text = "the quick brown fox, 12 letters<|im_end|>"
    assert wide(text)["input_ids"] == plain(text)["input_ids"]  # real tokens keep their ids
    assert e2e_peers.padded_tokenizer(str(model), tmp_path / "tok") == out  # kept across calls


def test_the_call_budget_counts_from_the_device_call_and_each_side_log_is_kept_at_once(tmp_path, monkeypatch):
    """device.sh exports E2E_CALL_STARTED (its install comes first) and E2E_TAG: the harness's budget
    counts from the call's start, and each side's log is in $OUT as soon as the side ends, before an
    outer timeout could end the call (session 28's cold call lost its side logs that way)."""
    import gzip
    import time

    base = e2e_peers.base
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    ran = []

    def side(name):
        def run(a, model, prompts, w, share, *rest):
            ran.append((name, share))
            (Path(w) / f"{name}.log").write_text(f"{name} ran {share:.0f} s\n")
            assert (out / "Q9_ours.log.gz").exists() == (name != "ours")  # ours' log kept before the peer starts
            return {"status": "ok", "steps": []}
        return run

    monkeypatch.setattr(base, "versions", lambda: {})
    monkeypatch.setattr(base, "ensure_model", lambda a: "/m")
    monkeypatch.setattr(base, "prompt_token_lengths", lambda model, rows: [1])
    monkeypatch.setattr(base, "wait_gpu_free", lambda: 0)
    monkeypatch.setattr(base, "run_ours", side("ours"))
    monkeypatch.setattr(e2e_peers, "run_openrlhf", side("openrlhf"))
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("E2E_TAG", "Q9")
    args = ["--work", str(work), "--sides", "ours,openrlhf", "--peer-tokens", "8192", "--budget-s", "500",
            "--side-cap-s", "400", "--side-reserve-s", "100"]
    monkeypatch.setenv("E2E_CALL_STARTED", str(time.time() - 200))  # the install took 200 s of the call
    e2e_peers.main(args)
    assert [n for n, _ in ran] == ["ours", "openrlhf"]
    assert ran[0][1] < 500 - 200 - 15 - 100 + 2  # ours' share: what the call has left, less the peer's reserve
    for name, share in ran:
        assert gzip.open(out / f"Q9_{name}.log.gz").read().decode() == f"{name} ran {share:.0f} s\n"
    ran.clear()
    monkeypatch.setenv("E2E_CALL_STARTED", str(time.time() - 460))  # too little left for any side
    e2e_peers.main(args)
    assert ran == []

"""bench.mfu_probe on CPU: the variants' plumbing on a tiny Qwen2 (the update, the token budgets, the head
alone, checkpointing, the profile, the JSON and table), its FLOP count against a formula written out
here, the profile's interval arithmetic, and the parent's time guards (a group skipped for budget, a
child killed at its limit). Liger is GPU-only (its rows carry the reason); layers compile on CPU with
the aot_eager backend (dynamo's tracing of the packed layer call, no inductor: ~30 s, so in the slow test).
The GPU run itself is scripts/gpu.sh's ``mfu-probe``."""

from __future__ import annotations

import json
import time

import pytest
import torch

from bench import mfu_probe as mp

ARGS = ["--device", "cpu", "--samples", "8", "--prompt", "4", "--response", "12", "--response-min", "6",
        "--repeats", "2", "--est-scale", "0.001", "--tokens-scale", "0.0039"]  # 32,768 → 127 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "m"
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rows(tiny) -> dict:
    a = mp.parser().parse_args(ARGS + ["--model", tiny])
    names = ["default", "tokens_16k", "tokens_64k", "head_only", "liger_flce", "ckpt"]
    return {n: mp.run_variant(n, tiny, a, "cpu", time.time() + 300) for n in names}


def test_variants_run_and_count_their_budgets(rows):
    for n in ("default", "tokens_16k", "tokens_64k", "ckpt"):
        r = rows[n]
        assert r["s"] > 0 and r["repeats"] == 2 and r["mfu"] == pytest.approx(r["tflops"] / 989.0)
        assert r["tflops"] == pytest.approx(r["flops"] / r["s"] / 1e12)
        assert max(r["micro_batch_tokens"]) <= r["tokens_budget"] or len(r["micro_batch_tokens"]) == 1
        assert r["micro_batch_tokens"] == sorted(r["micro_batch_tokens"], reverse=True)  # largest first
    # the same batch, cut by three budgets: more micro-batches under a smaller one, the same tokens and FLOPs
    counts = [len(rows[n]["micro_batch_tokens"]) for n in ("tokens_16k", "default", "tokens_64k")]
    assert counts[0] > counts[1] >= counts[2] >= 1
    assert len({sum(rows[n]["micro_batch_tokens"]) for n in ("tokens_16k", "default", "tokens_64k")}) == 1
    assert rows["tokens_16k"]["flops"] < rows["default"]["flops"] * 1.0000001  # attention Σs² only shrinks
    assert "Liger not applied (CPU run)" in rows["default"]["notes"]
    assert "needs CUDA" in rows["liger_flce"]["skipped"]


def test_head_alone_rows(rows):
    h = rows["head_only"]
    assert h["head_tokens"] == h["predicted_tokens"] or h["head_tokens"] < h["predicted_tokens"]
    assert set(h["heads"]) == {"product_compiled", "product_compiled_recomputed", "product_compiled_no_entropy",
                               "product_eager", "product_eager_recomputed"}
    assert all(v["s"] > 0 for v in h["heads"].values())
    assert h["head_flops"] == 3 * 2 * h["head_tokens"] * 256 * 64


def test_profile_on_cpu_lists_operators(rows):
    p = rows["default"]["profile"]
    assert p["kernels"] > 0 and p["top"] and sum(p["share_by_kind"].values()) == pytest.approx(1.0, abs=0.01)
    assert "gpu_idle_fraction" not in p  # no GPU window on CPU


def test_flops_match_the_formula(tiny):
    """6·N_body·L + 6·V·h·M + 6·layers·heads·head_dim·Σs², from the config's numbers (not flops.py)."""
    from rlhf.models.flops import flop_shape
    from rlhf.models.load import load_model

    m = load_model(tiny, "causal_lm", "float32")
    batch = mp.loop_batch(8, 4, 12, 6, 256)
    micro = mp.micro_batches(batch, 50)
    h, inter, L, nh, nkv = 64, 128, 2, 4, 2
    hd = h // nh
    body = L * (h * h + 2 * h * nkv * hd + h * h + 3 * h * inter)  # q, k, v, o; gate, up, down
    want = 0.0
    for p in micro:
        lens = (p["cu_seqlens"][1:] - p["cu_seqlens"][:-1]).double()
        want += 6.0 * body * lens.sum().item() + 6.0 * 256 * h * len(p["targets"]) + \
            6.0 * L * nh * hd * (lens ** 2).sum().item()
    assert mp.counted_flops(flop_shape(m), micro) == pytest.approx(want, rel=1e-12)
    assert all(int(p["input_ids"].numel()) <= 50 for p in micro) and len(micro) > 1


def test_busy_union_and_kinds():
    assert mp.busy_union([]) == (0.0, 0.0)
    assert mp.busy_union([(0, 2), (1, 3), (5, 6)]) == (4.0, 6.0)  # [0,3) ∪ [5,6): 4 busy in a 6 window
    assert mp.busy_union([(3, 4), (0, 10)]) == (10.0, 10.0)
    assert mp.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert mp.kernel_kind("nvjet_hsh_128x256_64x4") == "matmul"
    assert mp.kernel_kind("pytorch_flash::flash_fwd_kernel") == "attention"
    assert mp.kernel_kind("triton_red_fused__to_copy_mul_sum_3") == "reduction"
    assert mp.kernel_kind("triton_poi_fused_add_mul_silu_2") == "elementwise/other"
    assert mp.kernel_kind("Memcpy DtoD (Device -> Device)") == "copy"


def test_table_renders_every_row(rows):
    text = mp.table(list(rows.values()), 989.0)
    for n in ("default", "tokens_16k", "ckpt", "liger_flce", "head_only/product_eager"):
        assert f"| {n} |" in text
    assert "profile of default" in text


def test_parent_skips_a_group_without_time(tiny, tmp_path):
    assert mp.main(ARGS + ["--model", tiny, "--budget-s", "0", "--groups", "defaults", "--variants", "default",
                           "--est-scale", "1", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "mfu_probe.json").read_text())
    assert [r["variant"] for r in out["rows"]] == ["default"] and "budget" in out["rows"][0]["skipped"]
    with pytest.raises(SystemExit, match="unknown variant"):
        mp.main(ARGS + ["--variants", "warp_drive", "--out", str(tmp_path)])


def test_a_child_past_its_limit_is_killed_and_reported(tiny, tmp_path, monkeypatch):
    # a child that outlives any limit (a real probe child told "no time left" may print its skipped rows
    # and exit within the 1-s floor of the wait on a fast machine: not what this tests)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho started\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(mp.sys, "executable", str(fake))
    a = mp.parser().parse_args(ARGS + ["--model", tiny])
    t = time.time()
    got = mp.run_group("defaults", ["default", "ckpt"], 0.5, a, time.time() + 60, tmp_path)
    assert time.time() - t < 20
    assert [r["variant"] for r in got] == ["default", "ckpt"]
    assert all("killed at its time limit" in r["error"] and r["group"] == "defaults" for r in got)
    assert "started" in got[-1]["tail"]


@pytest.mark.slow
def test_whole_probe_in_child_processes_with_deepspeed(tiny, tmp_path):
    """Both CPU-runnable groups through their child processes, the DeepSpeed update (stage 0 on CPU) included."""
    assert mp.main(ARGS + ["--model", tiny, "--budget-s", "240", "--groups", "defaults,compiled_layers",
                           "--variants", "default,deepspeed,layers_compiled", "--out", str(tmp_path)]) == 0
    out = {r["variant"]: r for r in json.loads((tmp_path / "mfu_probe.json").read_text())["rows"]}
    assert set(out) == {"default", "deepspeed", "layers_compiled"}
    d = out["deepspeed"]
    assert d["s"] > d["optimizer_s"] > 0 and d["fwd_bwd_mfu"] > d["mfu"]
    assert out["default"]["group"] == "defaults" and out["layers_compiled"]["group"] == "compiled_layers"
    lc = out["layers_compiled"]  # dynamo traced the decoder layer as the packed pass calls it, in one graph
    assert "aot_eager" in " ".join(lc["notes"]) and lc["graphs"] >= 1 and lc["s"] > 0
    assert (tmp_path / "mfu_probe_defaults.log").exists()


def test_head_alone_times_kept_and_recomputed_logits(tiny):
    a = mp.parser().parse_args(ARGS + ["--model", tiny])
    row = mp.run_variant("head_only_no_liger", tiny, a, "cpu", time.time() + 300)
    heads = row["heads"]
    for name in ("product_compiled", "product_compiled_recomputed", "product_eager", "product_eager_recomputed"):
        assert heads[name]["s"] > 0, name
    assert "head_only/product_eager_recomputed" in mp.table([row], 989.0)


def test_the_optimizer_step_is_profiled_alone(tiny, monkeypatch):
    """A DeepSpeed variant with ``step_profile`` gets a profile of its boundary's ``engine.step()`` only:
    on CPU its operators are the optimizer's (no forward's matmuls)."""
    import dataclasses

    monkeypatch.setitem(mp.VARIANTS, "deepspeed", dataclasses.replace(mp.VARIANTS["deepspeed"], step_profile=True))
    a = mp.parser().parse_args(ARGS + ["--model", tiny, "--repeats", "1"])
    row = mp.run_variant("deepspeed", tiny, a, "cpu", time.time() + 300)
    prof = row["step_profile"]
    names = " ".join(t["name"] for t in prof["top"])
    assert prof["kernels"] > 0 and "aten::addcdiv_" in names and "aten::mm" not in names, names  # Adam's update
    assert "optimizer step of deepspeed" in mp.table([row], 989.0)


def test_entropy_is_a_statistic_unless_weighted():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ent = torch.tensor([0.5, 0.25], requires_grad=True)
    mp.loss_of(lp, ent, 0.0).backward()
    assert ent.grad is None and lp.grad.tolist() == [1.0, 1.0]
    mp.loss_of(lp, ent, 0.5).backward()
    assert ent.grad.tolist() == [0.5, 0.5]


def test_idle_gaps_are_the_stretches_without_a_running_kernel():
    # kernels as (start µs, end µs, name): two overlap, then a 400-µs wait, a 50-µs one (too short), a 1-ms one
    ks = [(0, 100, "a"), (50, 300, "b"), (700, 800, "c"), (850, 900, "d"), (1900, 2000, "e")]
    g = mp.idle_gaps(ks, min_us=100.0)
    assert g["count"] == 2 and g["ms"] == pytest.approx(1.4)
    assert g["top"][0] == {"at_ms": 0.9, "ms": 1.0, "after": "d", "before": "e"}
    assert g["top"][1] == {"at_ms": 0.3, "ms": 0.4, "after": "b", "before": "c"}
    assert mp.idle_gaps([]) == {"count": 0, "ms": 0.0, "top": []}


@pytest.mark.parametrize("entropy", [False, True])
def test_the_fused_grad_pass_equals_the_products_and_float64(entropy):
    """``fused_chunk_grad_into`` (a candidate, measured by the probe's ``head_passes`` group) writes the
    product's gradient: the same bf16 chunk as ``rlhf.algos.logprobs._chunk_grad_into`` up to one rounding,
    both within bf16 of float64; and ``head_passes`` swaps it in for a variant only."""
    from rlhf.algos import logprobs

    g0 = torch.Generator().manual_seed(4)
    rows, V, tau = 6, 40, 0.9
    zd = torch.randn(rows, V, generator=g0, dtype=torch.float64) * 3
    y = torch.randint(0, V, (rows,), generator=g0)
    zd[torch.arange(rows), y] += 4.0  # some rows peaked at their target
    logits = zd.bfloat16()
    z = logits.double() / tau
    lse, p = torch.logsumexp(z, -1), torch.softmax(z, -1)
    ez = (p * z).sum(-1)
    g = torch.randn(rows, generator=g0, dtype=torch.float64)
    e = torch.randn(rows, generator=g0, dtype=torch.float64) if entropy else None
    want = -p * (g[:, None] + (e[:, None] * (z - ez[:, None]) if entropy else 0.0))
    want[torch.arange(rows), y] += g
    want /= tau
    args = (y, lse.float(), ez.float() if entropy else None, g.float(), e.float() if entropy else None, tau)
    fused, product = logits.clone(), logits.clone()
    mp.fused_chunk_grad_into(fused, *args)
    logprobs._chunk_grad_into(product, *args)
    torch.testing.assert_close(fused.double(), want, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(fused, product, rtol=2**-7, atol=1e-6)
    with mp.head_passes("fused_grad"):
        assert logprobs._chunk_grad_into is mp.fused_chunk_grad_into
    assert logprobs._chunk_grad_into is not mp.fused_chunk_grad_into
    assert "deepspeed_z1_compiled_fused_grad" in dict((n, vs) for n, vs, _ in mp.GROUPS)["head_passes"]


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_the_fused_stats_pass_equals_the_products_and_float64(tau):
    """``fused_chunk_stats`` gives ``rlhf.algos.logprobs._chunk_stats``' log-probs, log-sum-exp and E_p[z]
    (float64 reference), and the whole head's values and gradients are unchanged with both candidates in."""
    from rlhf.algos import logprobs, logprobs_from_hidden

    g0 = torch.Generator().manual_seed(5)
    zd = torch.randn(7, 30, generator=g0, dtype=torch.float64) * 4
    y = torch.randint(0, 30, (7,), generator=g0)
    z = zd.float().bfloat16()
    ref = z.double() / tau
    want = (ref.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(ref, -1), torch.logsumexp(ref, -1),
            (torch.softmax(ref, -1) * ref).sum(-1))
    got = mp.fused_chunk_stats(z, y, tau, True)
    for a, b, c in zip(got, logprobs._chunk_stats(z.clone(), y, tau, True), want):
        torch.testing.assert_close(a.double(), c, rtol=0, atol=1e-5)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert mp.fused_chunk_stats(z, y, tau, False)[2] is None

    h = torch.randn(9, 8, generator=g0, dtype=torch.float64)
    head = torch.nn.Linear(8, 30, bias=False).double()
    t = torch.randint(0, 30, (9,), generator=g0)

    def run():
        x = h.clone().requires_grad_()
        head.weight.grad = None
        lp, ent = logprobs_from_hidden(x, head, t, tau, with_entropy=True, chunk_elements=30 * 4)
        (lp.sum() + 0.3 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad, head.weight.grad.clone()
    product = run()
    with mp.head_passes("fused"):
        assert logprobs._chunk_stats is mp.fused_chunk_stats
        fused = run()
    assert logprobs._chunk_stats is not mp.fused_chunk_stats
    for a, b in zip(fused, product):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)

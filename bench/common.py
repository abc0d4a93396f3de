"""Helpers shared by the GPU tests and benchmarks.

* ``make_random_model(out, preset)``: a randomly initialised Qwen2 checkpoint with the numbers of
  ``conf/model/<preset>.yaml`` (no hub), plus a small BPE tokenizer built with ``tokenizers``.
* ``TrainerStub``: a DeepSpeed-wrapped HF model on one GPU (ZeRO stage of your choice) that takes
  optimizer steps on random tokens, sends its weights to vLLM engines through the transports of
  ``rlhf.workers.sync_cuda``, and answers reference questions (HF greedy decoding, teacher-forced
  argmax, logprobs of given tokens, weight digests) from its *current* weights.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

ROOT = Path(__file__).resolve().parent.parent
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def preset(name: str) -> dict:
    with open(ROOT / "conf" / "model" / f"{name}.yaml") as f:
        d = yaml.safe_load(f)
    return {k: v for k, v in d.items() if k != "defaults"}


def _corpus() -> list[str]:
    import random

    rng = random.Random(0)
    words = ["the", "a", "model", "reward", "policy", "token", "answer", "question", "is", "of", "and",
             "to", "in", "value", "gradient", "sample", "step", "train", "learn", "number", "one", "two",
             "three", "four", "five", "six", "seven", "eight", "nine", "zero", "plus", "minus", "equals"]
    digits = [str(i) for i in range(100)]
    return [" ".join(rng.choice(words + digits) for _ in range(rng.randint(5, 30))) for _ in range(3000)]


def build_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE trained on a synthetic corpus; ids fit any model vocab >= vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def make_random_model(out: str | os.PathLike, preset_name: str = "qwen2.5-0.5b", seed: int = 0,
                      max_position_embeddings: int = 4096, device: Optional[str] = None) -> str:
    """Write a random Qwen2-shaped checkpoint (bf16) + tokenizer to ``out`` (skipped if present)."""
    import fcntl

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:  # concurrent jobs build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ((out / "config.json").exists() and (out / "tokenizer_config.json").exists()):
            _write_random_model(out, preset_name, seed, max_position_embeddings, device)
    return str(out)


def _write_random_model(out: Path, preset_name: str, seed: int, max_position_embeddings: int,
                        device: Optional[str]) -> None:
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.models.builtin import hf_shape

    p = preset(preset_name)
    tok = build_tokenizer()
    cfg = Qwen2Config(
        **hf_shape(p),
        max_position_embeddings=max_position_embeddings,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.pad_token_id,
        dtype="bfloat16",
    )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    del model


def prompts_ids(tokenizer, n: int, seed: int = 0, min_words: int = 4, max_words: int = 24) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    corpus = _corpus()
    out = []
    for _ in range(n):
        words = rng.choice(corpus).split()[: rng.randint(min_words, max_words)]
        ids = tokenizer(" ".join(words))["input_ids"]
        out.append(ids or [0])
    return out


def fixed_len_prompts(n: int, length: int, vocab: int = 2048, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def kill_tagged(var: str, tag: str, wait_s: float = 10.0) -> int:
    """SIGKILL every process (this one aside) whose environment has ``var=tag``: a run and what it
    started (Ray's workers inherit the variable). Waits up to ``wait_s`` until they are gone, since
    their GPU memory goes back only as they exit. Returns how many there were."""
    import signal

    want, me = f"{var}={tag}".encode(), os.getpid()
    killed = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int(proc.name) != me and want in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(proc)
        except (OSError, ValueError):
            continue
    end, left = time.time() + wait_s, killed
    while left and time.time() < end:
        time.sleep(0.05)
        left = [proc for proc in left if _running(proc)]
    return len(killed)


def _running(proc: Path) -> bool:
    """Not yet gone: a killed child stays a zombie (state Z) until its parent reaps it."""
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_single_rank_dist() -> None:
    """A one-rank torch.distributed world (DeepSpeed wants one) in this process."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl")


class TrainerStub:
    """A one-GPU DeepSpeed trainer of an HF causal LM, for weight-sync tests and benchmarks."""

    def __init__(self, model_path: str, zero_stage: int = 3, lr: float = 1e-4, seed: int = 0,
                 gradient_checkpointing: bool = False, fused_adam: bool = False) -> None:
        """``fused_adam``: DeepSpeed's FusedAdam (JIT-built on first use; ZeRO-3's offload_states
        accepts no other optimizer); else torch's AdamW."""
        for k, v in SAFE_ENV.items():
            os.environ.setdefault(k, v)
        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM

        torch.cuda.set_device(0)
        init_single_rank_dist()
        torch.manual_seed(seed)
        self.model_path = model_path
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        self.vocab = model.config.vocab_size
        if fused_adam:
            from deepspeed.ops.adam import FusedAdam

            opt = FusedAdam(model.parameters(), lr=lr, weight_decay=0.0)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        ds_cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": zero_stage},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
        self.zero_stage = zero_stage
        self.fused_adam = fused_adam
        self.offloaded = False
        self.sender: Any = None
        self._ref = None

    # ------------------------------------------------------------------ training

    def step(self, seed: int, batch: int = 4, seq: int = 128) -> float:
        """One optimizer step of next-token loss on random tokens (moves every weight)."""
        import torch

        if self.offloaded:
            self.reload()
        g = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.randint(3, min(self.vocab, 2048), (batch, seq), generator=g).cuda()
        self.engine.train()
        out = self.engine(input_ids=ids, labels=ids)
        self.engine.backward(out.loss)
        self.engine.step()
        self._ref = None
        return float(out.loss)

    def offload(self) -> float:
        import torch

        t0 = time.perf_counter()
        if self.zero_stage >= 1 and not self.offloaded:
            include = None
            if self.zero_stage == 3 and not self.fused_adam:  # ZeRO-3 moves optimizer states for FusedAdam only
                from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

                include = [S.lp_params, S.lp_grads, S.contiguous_grad_buffer]
            self.engine.offload_states(include=include)
            self.offloaded = True
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def reload(self) -> float:
        import torch

        t0 = time.perf_counter()
        if self.offloaded:
            self.engine.reload_states()
            self.offloaded = False
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def memory(self) -> dict:
        import torch

        free, total = torch.cuda.mem_get_info()
        return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.memory_reserved() / 2**30,
                "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "free_gib": free / 2**30, "total_gib": total / 2**30}

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()

    # ------------------------------------------------------------------ weight sync

    def setup_sync(self, mode: str, engines: Sequence[Any], engine_tp: Sequence[int] = ()) -> float:
        from rlhf.workers.sync_cuda import make_sender

        self.sender = make_sender(mode == "hybrid", engines, engine_tp)  # hybrid: the engines share our GPUs
        t = self.sender.setup()
        return float(t or 0.0)

    def sync(self, bucket_mb: int = 512) -> dict:
        from rlhf.workers.sync_cuda import WeightSource

        src = WeightSource(self.engine.module, bucket_bytes=bucket_mb << 20)
        return self.sender.send(src)

    # ------------------------------------------------------------------ references from the current weights

    def _reference(self):
        """A plain HF model holding a copy of the current (gathered) weights."""
        import deepspeed
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if self._ref is not None:
            return self._ref
        was_offloaded = self.offloaded
        if was_offloaded:
            self.reload()
        cfg = AutoConfig.from_pretrained(self.model_path)
        with torch.device("cuda"):
            ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        ref.eval()
        ref.config.use_cache = True
        src = dict(self.engine.module.named_parameters())
        params = list(src.values())
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if self.zero_stage == 3 else _null()
        with ctx, torch.no_grad():
            for name, p in ref.named_parameters():
                p.copy_(src[name].data)
        ref.tie_weights() if cfg.tie_word_embeddings else None
        if was_offloaded:
            self.offload()
        self._ref = ref
        return ref

    def digest(self) -> dict:
        import torch

        ref = self._reference()
        s = torch.zeros((), dtype=torch.float64, device="cuda")
        sq = torch.zeros_like(s)
        n, seen = 0, set()
        for _, p in ref.named_parameters():
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            x = p.detach().double()
            s += x.sum()
            sq += (x * x).sum()
            n += p.numel()
        return {"sum": float(s), "sumsq": float(sq), "numel": n}

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32) -> list[list[int]]:
        """Plain greedy decoding with HF's KV cache, one prompt at a time: argmax at every step,
        no logits processors, no EOS stop (like vLLM with temperature 0 and ignore_eos)."""
        import torch

        ref = self._reference()
        outs = []
        with torch.no_grad():
            for p in prompts:
                cur = torch.tensor([list(p)], device="cuda")
                past, toks = None, []
                for _ in range(max_new_tokens):
                    o = ref(input_ids=cur, past_key_values=past, use_cache=True)
                    past = o.past_key_values
                    nxt = int(o.logits[0, -1].float().argmax())
                    toks.append(nxt)
                    cur = torch.tensor([[nxt]], device="cuda")
                outs.append(toks)
        return outs

    def forced(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[dict]:
        """Teacher-forced: at each response position, HF's argmax, the logit margin of the given
        token under HF's max (0 when it is HF's argmax), and the given token's logprob."""
        import torch

        ref = self._reference()
        out = []
        with torch.no_grad():
            for p, r in zip(prompts, responses):
                ids = torch.tensor([list(p) + list(r)], device="cuda")
                logits = ref(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(r)].float()
                tok = torch.tensor(list(r), device="cuda")
                picked = logits.gather(1, tok[:, None])[:, 0]
                top = logits.max(dim=-1)
                logp = torch.log_softmax(logits, dim=-1).gather(1, tok[:, None])[:, 0]
                out.append({"argmax": top.indices.tolist(), "gap": (top.values - picked).tolist(),
                            "logp": logp.tolist()})
        return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def write_json(path: str | os.PathLike, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)

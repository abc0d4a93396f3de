"""Sampling responses: the rollout engines and what the RL loop, evaluation, async rollouts and
multi-turn environments share around them.

    engine.py     the RolloutEngine interface (generate, sample one request, load weights, sleep /
                  wake, close), Sampling, Sample, RequestBatcher (per-request sampling in-process)
    registry.py   engines by name: EngineKind (what the spec, plan, launcher and schedule know of an
                  engine before starting it), register_engine; rollout.plugins add more
    hf_kind.py    the HF kind: weights on the GPU, loads the model for its engine
    hf.py         HFEngine: Hugging Face sampling with the KV cache (CPU, GPU)
    vllm_kind.py  the vLLM kind: memory terms, launcher settings, sleep, device weight sync
    vllm.py       VLLMEngine: vLLM with sleep mode and weight-sync methods (GPU)
    vllm_ext.py   the methods vLLM's own workers get for weight sync (worker_extension_cls)
    generate.py   generate(engines, prompts, sampling): prompts sharded over the engines, order kept;
                  sampling_for: the seeds of a step's prompts

The engines run inside ``rlhf.workers.rollout.RolloutWorker`` (Ray actors; the run's kind makes
one there); nothing here imports vLLM at module level, and nothing outside this package compares
engine names.
"""

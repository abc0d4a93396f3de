"""Sampling responses: the rollout engines and what the RL loop, evaluation, async rollouts and
multi-turn environments share around them.

    engine.py     Sampling, Sample (one generated response), the RolloutEngine interface
    hf.py         HFEngine: Hugging Face generate-style sampling (CPU)
    vllm.py       VLLMEngine: vLLM with sleep mode and weight-sync methods (GPU)
    generate.py   generate(engines, prompts, sampling): prompts sharded over the engines, order kept;
                  sampling_for: the seeds of a step's prompts
    prompts.py    tokenize_prompts, score_samples (reward functions + reward model)

The engines run inside ``rlhf.workers.rollout.RolloutWorker`` (Ray actors; ``make_engine`` there
picks one); nothing here imports vLLM at module level.
"""

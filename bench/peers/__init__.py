"""veRL and OpenRLHF beside ours and TRL's in the end-to-end GRPO bench (``bench/e2e_peers.py``).

``shim/`` is a stand-in ``flash_attn`` package put on the peers' path only; ``reward_verl.py`` and
``reward_openrlhf.py`` hand each peer the same reward as ours and TRL's (``bench.rewards.letters``).
"""

"""Planning a built run before anything starts: what it needs and whether it fits.

    memory.py   the per-GPU memory estimate by phase or pool, the host memory per node, the fit rule
    disk.py     the disk a run writes under output_dir at its peak, and what makes it fit
    advice.py   settings that make a figure fit, each checked by building it
    auto.py     the values the build decides from the memory figures (ZeRO stage, offloads, budgets)
    render.py   the --plan text
    oom.py      CUDA out of memory in a phase: one line with the plan's figure and its advice

The spec (``rlhf.spec``) keeps the schema, the build and validation; the build calls
``auto.resolve`` here. Nothing here imports torch or Ray.
"""

"""Placement as data: which role runs on which devices and what shares a device.

    registry.py   placements by name (placement.mode): PlacementKind says which roles share devices
                  (its pools); hybrid (one pool) and disaggregated (a pool per role) ship, and
                  placement.plugins add more; each kind's rules for the placement section
    layout.py     Layout, the one object built from the spec (RunSpec.layout): devices per role, the
                  engines' TP groups, the pools, and the questions the launcher, the schedule, the
                  plan and the failure lines ask of it (does the rollout share the actor's devices?
                  which memory figure holds this role?)

Nothing outside this package compares ``placement.mode``: it names a kind, and the kind's pools
decide.
"""

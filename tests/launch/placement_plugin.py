"""A placement from a plugin module (``placement.plugins=[tests.launch.placement_plugin]``,
``placement=actor_with_reference``): the actor and the reference model share devices (the
reference's forward pass runs where the policy trains), every other role has its own. Nothing
in rlhf/ names it."""

from __future__ import annotations

from rlhf.placement.registry import PlacementKind, register_placement, together


@register_placement
class ActorWithReference(PlacementKind):
    name = "actor_with_reference"

    def pools(self, roles):
        return together(roles, ("actor", "reference"))

"""The reconciler writes children in dependency order (fake_kube): what a Deployment's Pods and the
HTTPRoute refer to exists before them, so a first deploy or a new revision shows no FailedCreate; the
route goes before the revisions' Deployments are scaled or deleted (docs/rollout-traffic.md)."""

from __future__ import annotations

from op_helpers import spec_dict
from reconcile_scenarios import REV_B, World

from graphserving.operator import naming

ROUTE = {"parentRefs": [{"name": "gw"}]}


def _applies(world: World, since: int = 0) -> list[tuple[str, str]]:
    return [(m, n) for m, n in world.kube.written()[since:] if m.startswith(("apply ", "scale ", "delete "))]


def test_a_new_revision_gets_its_service_then_the_route_then_its_deployment():
    world = World.new()
    world.create(replicas=1, routing=ROUTE)
    world.settle(3)
    old = naming.revision_name("gs", world.status()["currentRevision"])
    before = len(world.kube.written())
    world.edit(model={**spec_dict()["model"], "revision": REV_B})
    world.reconcile()
    new = naming.revision_name("gs", world.status()["currentRevision"])
    assert new != old
    assert _applies(world, before) == [
        ("apply Service", new),  # the PodDisruptionBudget is unchanged: not written again
        ("apply HTTPRoute", "gs"),  # naming the new revision's Service, which exists, at weight 0
        ("apply Deployment", new),
    ]


def test_the_worker_service_account_precedes_every_deployment_in_a_fresh_namespace():
    world = World.new()
    world.create(replicas=2)
    world.reconcile()
    kinds = [m.removeprefix("apply ") for m, _ in _applies(world)]
    assert kinds.index("ServiceAccount") < kinds.index("RoleBinding") < kinds.index("Deployment")
    assert kinds.index("Service") < kinds.index("Deployment")

"""The test API server's field ownership (tests/kube_fields.py) follows the API server's rules
for server-side apply: what the autoscaling hand-over test relies on."""

from __future__ import annotations

import pytest

from tests.kube_fields import ApplyConflict, apply, owners, update


def deployment(**spec: object) -> dict[str, object]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}, "spec": spec}


def test_dropping_a_field_its_only_owner_applied_removes_it() -> None:
    live = apply(None, deployment(replicas=3, paused=False), "operator", force=True)
    after = apply(live, deployment(paused=False), "operator", force=True)
    assert "replicas" not in after["spec"]  # the API server then defaults it: the dip to 1


def test_a_field_another_manager_owns_too_stays_when_one_drops_it() -> None:
    live = apply(None, deployment(replicas=3, paused=False), "operator", force=True)
    live = apply(live, deployment(replicas=3), "handoff", force=False)  # same value: shared
    assert owners(live)[("handoff", "Apply")] == {("spec", "replicas")}
    after = apply(live, deployment(paused=False), "operator", force=True)
    assert after["spec"]["replicas"] == 3


def test_an_update_takes_the_fields_it_changes_from_every_manager() -> None:
    live = apply(None, deployment(replicas=3), "operator", force=True)
    scaled = update(live, {**live, "spec": {"replicas": 5}}, "kube-controller-manager")
    held = owners(scaled)
    assert held[("kube-controller-manager", "Update")] == {("spec", "replicas")}
    assert ("operator", "Apply") not in held  # it owned nothing else
    # ... so an apply without the field leaves it where the autoscaler put it.
    assert apply(scaled, deployment(paused=True), "operator", force=True)["spec"]["replicas"] == 5


def test_a_different_value_is_a_conflict_unless_forced() -> None:
    live = apply(None, deployment(replicas=3), "operator", force=True)
    scaled = update(live, {**live, "spec": {"replicas": 5}}, "kube-controller-manager")
    with pytest.raises(ApplyConflict, match=r"spec\.replicas \(owned by kube-controller-manager\)"):
        apply(scaled, deployment(replicas=3), "handoff", force=False)
    taken = apply(scaled, deployment(replicas=4), "operator", force=True)
    assert taken["spec"]["replicas"] == 4
    assert ("kube-controller-manager", "Update") not in owners(taken)

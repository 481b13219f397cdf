"""Status (pure): when a pipeline is Ready, Progressing or Degraded, read from its Deployments."""

from __future__ import annotations

from typing import Any

import yaml

from omni_operator.status import ConditionType, pipeline_status, rollout
from omni_pipeline.spec import PipelineFile, parse_pipeline
from tests.helpers import ROOT


def demo() -> PipelineFile:
    return parse_pipeline(yaml.safe_load((ROOT / "examples" / "tiny-omni-distributed.yaml").read_text()))


def done(name: str, replicas: int = 1, generation: int = 1) -> dict[str, Any]:
    """A Deployment whose controller reports `replicas` rolled out for `generation`."""
    counts = ("replicas", "updatedReplicas", "readyReplicas", "availableReplicas")
    return {
        "metadata": {"name": name, "generation": generation},
        "spec": {"replicas": replicas},
        "status": {"observedGeneration": generation, **dict.fromkeys(counts, replicas)},
    }


def all_done() -> dict[str, dict[str, Any]]:
    p = demo()
    names = [f"tiny-omni-{s.name}" for s in p.spec.stages] + ["tiny-omni-gateway"]
    return {n: done(n, replicas=2 if n.endswith(("talker", "vocoder", "gateway")) else 1) for n in names}


def condition(status: Any, kind: ConditionType) -> Any:
    return next(c for c in status.conditions if c.type == kind)


def test_rollout_needs_the_latest_generation_every_replica_updated_and_none_old() -> None:
    assert rollout("s", done("d", 2)).rolled_out
    lagging = done("d", 2, generation=3)
    lagging["status"]["observedGeneration"] = 2
    assert not rollout("s", lagging).rolled_out
    surge = done("d", 2)
    surge["status"]["replicas"] = 3  # one pod of the old template still running
    assert not rollout("s", surge).rolled_out
    half = done("d", 2)
    half["status"]["availableReplicas"] = 1
    assert not rollout("s", half).rolled_out
    assert not rollout("s", None).rolled_out


def test_ready_when_every_stage_and_the_gateway_rolled_out() -> None:
    status = pipeline_status(demo(), "ml", 4, all_done(), [])
    assert condition(status, ConditionType.READY).status == "True"
    assert condition(status, ConditionType.PROGRESSING).status == "False"
    assert status.stages_ready == "3/3" and status.observed_generation == 4
    assert status.gateway_url == "http://tiny-omni-gateway.ml.svc:8000/v1"


def test_a_paused_stage_is_ready_and_said_to_be_paused() -> None:
    """Its replicas sleep, up and ready (a sleeping replica passes its readiness probe), so the
    pipeline is Ready; the status says which stage sleeps by the spec."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-omni-distributed.yaml").read_text())
    doc["spec"]["stages"][1]["paused"] = True
    status = pipeline_status(parse_pipeline(doc), "ml", 4, all_done(), [])
    ready = condition(status, ConditionType.READY)
    assert ready.status == "True" and "talker paused" in ready.message
    assert [s.paused for s in status.stages] == [False, True, False]


def test_waiting_names_the_stage_and_a_stuck_rollout_is_degraded() -> None:
    deployments = all_done()
    deployments["tiny-omni-talker"]["status"]["availableReplicas"] = 1
    status = pipeline_status(demo(), "ml", 1, deployments, [])
    ready = condition(status, ConditionType.READY)
    assert ready.status == "False" and "talker 1/2 available" in ready.message
    assert condition(status, ConditionType.PROGRESSING).status == "True"
    assert status.stages_ready == "2/3"

    stuck = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
    stuck["message"] = "too slow"
    deployments["tiny-omni-talker"]["status"]["conditions"] = [stuck]
    status = pipeline_status(demo(), "ml", 1, deployments, [])
    degraded = condition(status, ConditionType.DEGRADED)
    assert degraded.status == "True" and degraded.message == "talker: too slow"
    assert condition(status, ConditionType.PROGRESSING).reason == "Stalled"


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first = pipeline_status(demo(), "ml", 1, all_done(), [])
    previous = [c.model_dump(by_alias=True) for c in first.conditions]
    for c in previous:
        c["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    again = pipeline_status(demo(), "ml", 1, all_done(), previous)
    assert all(c.last_transition_time == "2020-01-01T00:00:00Z" for c in again.conditions)
    broken = all_done()
    broken["tiny-omni-thinker"]["status"]["availableReplicas"] = 0
    changed = pipeline_status(demo(), "ml", 1, broken, previous)
    assert condition(changed, ConditionType.READY).last_transition_time != "2020-01-01T00:00:00Z"
    assert condition(changed, ConditionType.INVALID_SPEC).last_transition_time == "2020-01-01T00:00:00Z"

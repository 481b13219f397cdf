"""An OmniPipeline's status, computed from its spec and its child Deployments. Pure: no API calls.

Ready means the user's latest spec is what serves: the operator rendered this generation and
every child Deployment has rolled it out (its controller saw its latest generation, and every
desired replica is updated and available, none of an older template left). The model is also
the CRD's status schema, so `kubectl explain omp.status` describes these fields.
"""

from __future__ import annotations

import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from omni_pipeline.spec import Mode, PipelineFile

from .render import Names


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    INVALID_SPEC = "InvalidSpec"


Note = tuple[ConditionType, str, str, str]
"""(type, status, reason, message) of one condition."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class Condition(_Model):
    """One observation, in the Kubernetes condition convention."""

    type: ConditionType = Field(description="Ready, Progressing, Degraded or InvalidSpec.")
    status: str = Field(description="True, False or Unknown.")
    reason: str = Field(description="A CamelCase word saying why.")
    message: str = Field(description="What a person needs to know, naming the stage.")
    observed_generation: int = Field(description="The spec generation this was observed for.")
    last_transition_time: str = Field(description="When the status last changed (RFC 3339).")


class DeploymentStatus(_Model):
    """The rollout of one child Deployment: a stage's replicas, or the gateway's."""

    name: str = Field(description="The stage name, or `gateway`.")
    deployment: str = Field(description="The Deployment serving it.")
    replicas: int = Field(description="Desired replicas.")
    ready_replicas: int = Field(0, description="Replicas passing their readiness probe.")
    updated_replicas: int = Field(0, description="Replicas running the current template.")
    available_replicas: int = Field(0, description="Replicas ready for at least minReadySeconds.")
    rolled_out: bool = Field(False, description="Every desired replica is updated and available.")
    paused: bool = Field(False, description="The stage is paused (spec.stages[].paused): its replicas sleep.")


class PipelineStatus(_Model):
    """Written by the operator: conditions, per-stage replicas, the gateway URL."""

    observed_generation: int = Field(0, description="The spec generation the operator last rendered.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, ...")
    stages: list[DeploymentStatus] = Field(default_factory=list, description="Per stage replicas.")
    gateway: DeploymentStatus | None = Field(None, description="The gateway's replicas.")
    stages_ready: str = Field("", description="Stages rolled out / stages, e.g. 2/3.")
    gateway_url: str = Field(
        "", alias="gatewayURL", description="The OpenAI-compatible base URL inside the cluster."
    )


def rollout(name: str, deployment: dict[str, Any] | None) -> DeploymentStatus:
    """Read a Deployment's status the way `kubectl rollout status` does."""
    if deployment is None:
        return DeploymentStatus(name=name, deployment="", replicas=0)
    spec, status = deployment.get("spec", {}), deployment.get("status") or {}
    desired = int(spec.get("replicas", 1))
    counts = {k: int(status.get(k) or 0) for k in ("replicas", "readyReplicas", "updatedReplicas")}
    available = int(status.get("availableReplicas") or 0)
    observed = int(status.get("observedGeneration") or 0) >= int(deployment["metadata"].get("generation", 1))
    done = (
        observed
        and counts["updatedReplicas"] >= desired
        and counts["replicas"] == counts["updatedReplicas"]  # no replica of an older template left
        and available >= desired
    )
    return DeploymentStatus(
        name=name,
        deployment=deployment["metadata"]["name"],
        replicas=desired,
        ready_replicas=counts["readyReplicas"],
        updated_replicas=counts["updatedReplicas"],
        available_replicas=available,
        rolled_out=done,
    )


def failure(deployment: dict[str, Any] | None) -> str | None:
    """Why a Deployment cannot progress, if its controller says so."""
    for c in (deployment or {}).get("status", {}).get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("status") == "False":
            return c.get("message") or c.get("reason") or "progress deadline exceeded"
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            return c.get("message") or c.get("reason") or "replica failure"
    return None


def gateway_url(pipeline: PipelineFile, namespace: str) -> str:
    names = Names(pipeline.name)
    service = names.single_node if pipeline.spec.mode is Mode.SINGLE_NODE else names.gateway
    return f"http://{service}.{namespace}.svc:{pipeline.spec.gateway.port or 8000}/v1"


def pipeline_status(
    pipeline: PipelineFile,
    namespace: str,
    generation: int,
    deployments: dict[str, dict[str, Any]],
    previous: list[dict[str, Any]],
) -> PipelineStatus:
    """Status for `pipeline` rendered at `generation`, given its child Deployments by name."""
    names = Names(pipeline.name)
    single = pipeline.spec.mode is Mode.SINGLE_NODE

    def deployment_of(stage: str) -> str:
        return names.single_node if single else names.stage(stage)

    stages = [
        rollout(s.name, deployments.get(deployment_of(s.name))).model_copy(update={"paused": s.paused})
        for s in pipeline.spec.stages
    ]
    gateway = rollout("gateway", deployments.get(names.single_node if single else names.gateway))
    parts = [*stages, gateway]
    waiting = [p for p in parts if not p.rolled_out]
    failed = [(p.name, why) for p in parts if (why := failure(deployments.get(p.deployment)))]
    ready_count = sum(s.rolled_out for s in stages)
    if not waiting:
        what = f"all {len(stages)} stages and the gateway are ready"
        if paused := [s.name for s in stages if s.paused]:
            what += f" ({', '.join(paused)} paused: asleep until unpaused)"
        ready = (ConditionType.READY, "True", "RolledOut", what)
    else:
        what = "; ".join(f"{p.name} {p.available_replicas}/{p.replicas} available" for p in waiting)
        ready = (ConditionType.READY, "False", "RollingOut", f"waiting for {what}")
    progressing = (
        (ConditionType.PROGRESSING, "True", "RollingOut", ready[3])
        if waiting and not failed
        else (ConditionType.PROGRESSING, "False", "Done" if not waiting else "Stalled", ready[3])
    )
    degraded = (
        (ConditionType.DEGRADED, "True", "RolloutFailed", "; ".join(f"{n}: {w}" for n, w in failed))
        if failed
        else (ConditionType.DEGRADED, "False", "AsExpected", "no failure reported")
    )
    valid = (ConditionType.INVALID_SPEC, "False", "Valid", "the spec is valid")
    return PipelineStatus(
        observed_generation=generation,
        conditions=conditions([ready, progressing, degraded, valid], generation, previous),
        stages=stages,
        gateway=gateway,
        stages_ready=f"{ready_count}/{len(stages)}",
        gateway_url=gateway_url(pipeline, namespace),
    )


def invalid_spec(message: str) -> list[Note]:
    """Children of an earlier valid generation keep serving; this generation is refused."""
    return [
        (ConditionType.INVALID_SPEC, "True", "InvalidSpec", message),
        (ConditionType.READY, "False", "InvalidSpec", "the latest spec is invalid; see InvalidSpec"),
    ]


def apply_failed(message: str) -> list[Note]:
    return [
        (ConditionType.DEGRADED, "True", "ApplyFailed", message),
        (ConditionType.READY, "False", "ApplyFailed", "the latest spec could not be applied; see Degraded"),
    ]


def noted(generation: int, notes: list[Note], previous_status: dict[str, Any]) -> dict[str, Any]:
    """A status patch that sets these conditions and leaves the rest of the status as it was."""
    previous = previous_status.get("conditions") or []
    replaced = {n[0] for n in notes}
    kept = [c for c in previous if c.get("type") not in replaced]
    fresh = [c.model_dump(by_alias=True, mode="json") for c in conditions(notes, generation, previous)]
    return {"observedGeneration": generation, "conditions": [*fresh, *kept]}


def conditions(notes: list[Note], generation: int, previous: list[dict[str, Any]]) -> list[Condition]:
    """Conditions from (type, status, reason, message); a transition time moves only on a change."""
    before = {c.get("type"): c for c in previous}
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = []
    for kind, status, reason, message in notes:
        old = before.get(kind, {})
        since = old.get("lastTransitionTime") if old.get("status") == status else None
        out.append(
            Condition(
                type=kind,
                status=status,
                reason=reason,
                message=message,
                observed_generation=generation,
                last_transition_time=since or now,
            )
        )
    return out

"""Which of a single-node pod's GPUs each stage replica runs on.

Without placement every stage process sees every GPU and its engine takes the first, so all
stages pile onto GPU 0. Placed, each replica sees only its own devices (the supervisor sets
`CUDA_VISIBLE_DEVICES` for it): explicitly (`stages[].devices`, as vLLM-Omni's stage configs
say `devices: "0"`), or packed in file order by `resources.gpus`, onto devices no explicit
stage took. Devices are indices into the pod's GPUs (those its `CUDA_VISIBLE_DEVICES` lists,
or all it has). A device two replicas use must be shared on purpose (`shareDevice` on each)
and split by `gpuMemoryFraction`, at most 1 in all. In Distributed mode each replica is its
own pod, and Kubernetes' device plugin places it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

VISIBLE_DEVICES_ENV: Final = "CUDA_VISIBLE_DEVICES"


class PlacementError(ValueError):
    """A placement that cannot work; the message names the stage."""


class _Resources(Protocol):
    @property
    def gpus(self) -> int: ...


class StageSpec(Protocol):
    """What placement reads of a stage (omni_pipeline.spec's StageSpec; the spec validates
    itself with this module, so this module does not import it)."""

    @property
    def name(self) -> str: ...
    @property
    def replicas(self) -> int: ...
    @property
    def devices(self) -> str | None: ...
    @property
    def resources(self) -> _Resources: ...
    @property
    def share_device(self) -> bool: ...
    @property
    def gpu_memory_fraction(self) -> float | None: ...


class PipelineSpec(Protocol):
    """What placement reads of a pipeline: its stages, in file order."""

    @property
    def stages(self) -> Sequence[StageSpec]: ...


@dataclass(frozen=True)
class Placement:
    devices: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    """(stage, replica index) -> the pod's device indices it sees; empty: no GPU."""

    @property
    def device_count(self) -> int:
        """The GPUs the pod needs: one past the highest index placed."""
        return 1 + max((d for ds in self.devices.values() for d in ds), default=-1)

    def visible(self, stage: str, replica: int, pod_devices: list[str]) -> str:
        """`CUDA_VISIBLE_DEVICES` for one replica: its devices among the pod's (their ids)."""
        return ",".join(pod_devices[d] for d in self.devices.get((stage, replica), []))


def visible_gpus() -> list[str]:
    """This machine's GPUs as a process here sees them: the ids CUDA_VISIBLE_DEVICES lists, or
    all the driver has (torch counts them; the children are spawned, so CUDA starting here is
    harmless)."""
    if (listed := os.environ.get(VISIBLE_DEVICES_ENV)) is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def uses_gpus(spec: PipelineSpec) -> bool:
    return any(s.resources.gpus or s.devices for s in spec.stages)


def explicit_devices(stage: StageSpec) -> list[int]:
    return [int(d) for d in stage.devices.split(",")] if stage.devices else []


def place(spec: PipelineSpec, available: int | None = None) -> Placement:
    """Every replica's devices; `available`: how many GPUs the pod has (None: as many as it
    takes, which is what a SingleNode pod then asks Kubernetes for)."""
    placed: dict[tuple[str, int], list[int]] = {}
    taken: set[int] = set()
    for s in spec.stages:
        if not (wanted := explicit_devices(s)):
            continue
        if len(wanted) != s.replicas * s.resources.gpus:
            raise PlacementError(
                f"stage '{s.name}': devices: {len(wanted)} listed, but {s.replicas} replicas of "
                f"resources.gpus {s.resources.gpus} need {s.replicas * s.resources.gpus}"
            )
        for r in range(s.replicas):
            placed[(s.name, r)] = wanted[r * s.resources.gpus : (r + 1) * s.resources.gpus]
        taken.update(wanted)
    free = (d for d in range(available if available is not None else 1 << 16) if d not in taken)
    for s in spec.stages:
        if s.devices:
            continue
        for r in range(s.replicas):
            got = [d for _, d in zip(range(s.resources.gpus), free, strict=False)]
            if len(got) < s.resources.gpus:
                raise PlacementError(
                    f"stage '{s.name}': resources.gpus: replica {r} needs {s.resources.gpus}, but other "
                    f"stages took all {available} GPUs there are"
                )
            placed[(s.name, r)] = got
    placement = Placement(placed)
    if available is not None and placement.device_count > available:
        stage = next(s for (s, _), ds in placed.items() if ds and max(ds) >= available)
        raise PlacementError(
            f"stage '{stage}': devices: device {placement.device_count - 1} asked for, but there are "
            f"{available} GPUs (CUDA_VISIBLE_DEVICES, else all the driver has)"
        )
    _check_sharing(spec, placement)
    return placement


def _check_sharing(spec: PipelineSpec, placement: Placement) -> None:
    users: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for key, ds in placement.devices.items():
        for d in set(ds):
            users[d].append(key)
    for d, on in sorted(users.items()):
        if len(on) < 2:
            continue
        names = ", ".join(f"'{s}' replica {r}" for s, r in on)
        by_name = {s.name: s for s in spec.stages}
        stages = [by_name[s] for s, _ in on]
        if unshared := next((s for s in stages if not s.share_device), None):
            raise PlacementError(
                f"stage '{unshared.name}': devices: device {d} is used by {names}; set shareDevice: true "
                "on each stage that shares it"
            )
        if unsized := next((s for s in stages if s.gpu_memory_fraction is None), None):
            raise PlacementError(
                f"stage '{unsized.name}': gpuMemoryFraction: required on a shared device "
                f"(device {d}: {names})"
            )
        total = sum(s.gpu_memory_fraction or 0.0 for s in stages)
        if total > 1.0 + 1e-9:
            raise PlacementError(
                f"stage '{stages[-1].name}': gpuMemoryFraction: the shares on device {d} ({names}) sum to "
                f"{total:g}, more than 1"
            )

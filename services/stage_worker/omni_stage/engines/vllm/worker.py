"""vLLM workers that also send each step's last hidden states to the stage (hidden.py).

vLLM imports this module inside its own worker processes (`worker_cls`): one class per
platform, each vLLM's own worker with one change: after `init_device` builds its model runner,
the runner's `sample_tokens` first sends the rows its forward left in `execute_model_state`
(the last layer's normed states: what the logits are computed from), then samples as before.
Written against vLLM's V1 model runner (`GPUModelRunner`, which the CPU runner extends): the
stage starts vLLM with `VLLM_USE_V2_MODEL_RUNNER=0`, since vLLM picks V2 by default where
Triton is installed (GPUs).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch
import zmq
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from omni_stage.engines.vllm.hidden import ADDRESS_ENV, HiddenRows


class _Sender:
    """Wraps a model runner's `sample_tokens`: each request's rows of this step, then the step."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.sample = runner.sample_tokens
        self.socket = zmq.Context.instance().socket(zmq.PUSH)
        self.socket.connect(os.environ[ADDRESS_ENV])
        self.encoder = msgspec.msgpack.Encoder()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.runner.execute_model_state
        if state is not None:
            self.send(state.scheduler_output, state.hidden_states)
        return self.sample(*args, **kwargs)

    def send(self, scheduled: Any, hidden: torch.Tensor) -> None:
        batch = self.runner.input_batch
        counts = [int(scheduled.num_scheduled_tokens.get(req, 0)) for req in batch.req_ids]
        host = hidden[: sum(counts)].float().cpu()  # one copy off the device a step
        row = 0
        for i, (req, n) in enumerate(zip(batch.req_ids, counts, strict=True)):
            if n == 0:
                continue
            rows = host[row : row + n].contiguous()
            row += n
            head = HiddenRows(req, int(batch.num_computed_tokens_cpu[i]), n, int(rows.shape[1]))
            self.socket.send_multipart([self.encoder.encode(head), rows.numpy().tobytes()], copy=False)


def _install(worker: Any) -> None:
    if not isinstance(worker.model_runner, GPUModelRunner):  # the CPU runner is one too
        raise RuntimeError(
            f"the Qwen thinker's hidden states are read from vLLM's V1 model runner, not "
            f"{type(worker.model_runner).__name__} (VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    if get_pp_group().is_last_rank and get_tp_group().rank_in_group == 0:
        worker.model_runner.sample_tokens = _Sender(worker.model_runner)


class CPUHiddenStatesWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        _install(self)


class GPUHiddenStatesWorker(Worker):
    def init_device(self) -> None:
        super().init_device()
        _install(self)

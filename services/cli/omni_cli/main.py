"""The `omni` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_pipeline.connection import nats_security, resolve_nats_url
from omni_pipeline.connectors import ConnectorError
from omni_pipeline.control import ControlError
from omni_pipeline.environment import NATS_URL_ENV
from omni_pipeline.lifecycle import exit_process, start_fork_server, stop_fork_server
from omni_pipeline.logs import configure_logging
from omni_pipeline.spec import Mode, PipelineFile, SpecError, load_pipeline
from omni_stage.models.releases import REAL_SIZED


def _nats_url(arg: str | None, pipeline: PipelineFile) -> str | None:
    return arg or os.environ.get(NATS_URL_ENV) or pipeline.spec.nats.url or None


def _checked_nats_url(arg: str | None, pipeline: PipelineFile) -> str:
    """The NATS URL and security settings, checked before anything starts (ControlError)."""
    url = resolve_nats_url(_nats_url(arg, pipeline))
    nats_security()
    return url


def _api_keys_readable() -> bool:
    """Bad API key settings stop `omni gateway` and `omni serve` at once, before the gateway's
    app (and torch) loads or a stage starts; the gateway reads them again as it starts."""
    from omni_gateway.guards import ApiKeyError, load_api_keys

    try:
        load_api_keys()
    except ApiKeyError as exc:
        print(f"omni: {exc}", file=sys.stderr)
        return False
    return True


def _log_ready(what: str) -> Callable[[dict[str, Any]], None]:
    return lambda info: logging.getLogger("omni").info("%s ready: %s", what, info)


def cmd_serve(a: argparse.Namespace) -> int:
    from omni_cli.serve import Supervisor

    pipeline = load_pipeline(a.pipeline)
    url = _nats_url(a.nats, pipeline)
    if url:
        _checked_nats_url(url, pipeline)
    if not _api_keys_readable():
        return 2
    port = a.port if a.port is not None else pipeline.spec.gateway.port
    return Supervisor(pipeline, a.pipeline, a.host, port, url).run()


def cmd_run_batch(a: argparse.Namespace) -> int:
    from omni_cli.run_batch import run_batch

    pipeline = load_pipeline(str(a.pipeline))  # a bad file stops here, before anything starts
    if pipeline.spec.mode is not Mode.SINGLE_NODE:
        raise SpecError(f"{a.pipeline}: run-batch serves a pipeline on this machine: mode must be SingleNode")
    return run_batch(a.pipeline, a.input_file, a.output_file)


def cmd_stage(a: argparse.Namespace) -> int:
    pipeline = load_pipeline(a.pipeline)
    if a.stage not in {s.name for s in pipeline.spec.stages}:
        raise SpecError(f"{a.pipeline}: no stage named '{a.stage}'")
    url = _checked_nats_url(a.nats, pipeline)
    from omni_stage.proc import run_stage  # torch and the engines: only once the arguments hold

    run_stage(
        _log_ready(f"stage {a.stage}/{a.replica_id}"),
        pipeline,
        a.stage,
        a.replica_id,
        url,
        a.metrics_host,
        a.metrics_port,
        a.pipeline,
    )
    exit_process(0)  # as a pod's main process: no interpreter teardown (omni_pipeline.lifecycle)


def cmd_gateway(a: argparse.Namespace) -> int:
    pipeline = load_pipeline(a.pipeline)
    url = _checked_nats_url(a.nats, pipeline)
    if not _api_keys_readable():
        return 2
    from omni_gateway.app import run_gateway  # the web app, torch: only once the settings hold
    from omni_gateway.guards import ApiKeyError

    port = a.port if a.port is not None else pipeline.spec.gateway.port
    try:
        run_gateway(_log_ready("gateway"), pipeline, url, a.host, port, wait_for_stages=False)
    except ApiKeyError as exc:
        print(f"omni: {exc}", file=sys.stderr)
        return 2
    exit_process(0)  # as a pod's main process: no interpreter teardown (omni_pipeline.lifecycle)


def cmd_init_demo(a: argparse.Namespace) -> int:
    from omni_stage.demo import init_demo

    for name, path in init_demo(a.dir).items():
        print(f"{name}: {path}")
    return 0


def cmd_init_config_only(a: argparse.Namespace) -> int:
    return _write_real_sized(a, weights=False)


def cmd_init_random(a: argparse.Namespace) -> int:
    return _write_real_sized(a, weights=True)


def _write_real_sized(a: argparse.Namespace, weights: bool) -> int:
    """`omni models init-config-only` (`weights` false) and `init-random`: a real-sized checkpoint
    of `a.model`, with or without its weights."""
    if a.model not in REAL_SIZED:  # before the writers load torch and transformers
        print(f"omni: unknown model {a.model!r}: one of {', '.join(REAL_SIZED)}", file=sys.stderr)
        return 2
    import torch

    from omni_stage.models.qwen2_5_omni import checkpoint as qwen2_5_omni
    from omni_stage.models.qwen3_omni import checkpoint as qwen3_omni
    from omni_stage.models.qwen3_tts import checkpoint as qwen3_tts

    omni = {"qwen3-omni": qwen3_omni, "qwen2.5-omni": qwen2_5_omni}
    path = Path(a.dir)
    if not weights:
        if a.model in omni:
            written = omni[a.model].write_config_only(path)
        else:
            written = qwen3_tts.write_config_only(path, a.model)
        print(f"{a.model}: {written} (serve with engine.args.loadFormat: dummy)")
        return 0
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"omni: --device {a.device}: this machine has no CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    if a.model in omni:
        written = omni[a.model].write_random(path, a.device, dtype, a.max_shard_size)
    else:
        written = qwen3_tts.write_random(path, a.model, a.device, dtype)
    print(f"{a.model}: {written} (random weights; serve with engine.args.loadFormat: auto)")
    return 0


def cmd_crd(a: argparse.Namespace) -> int:
    import yaml

    from omni_operator.crd import crd

    print(yaml.safe_dump(crd(), sort_keys=False, width=120), end="")
    return 0


def cmd_render(a: argparse.Namespace) -> int:
    from omni_operator.render import DEFAULT_IMAGE, render, render_yaml, unservable

    pipeline = load_pipeline(a.pipeline)
    if problems := unservable(pipeline):
        raise SpecError(f"{a.pipeline}: cannot run on Kubernetes:\n  " + "\n  ".join(problems))
    objects = render(pipeline, namespace=a.namespace, image=a.image or DEFAULT_IMAGE)
    print(render_yaml(objects), end="")
    return 0


def cmd_operator(a: argparse.Namespace) -> int:
    from omni_operator.handlers import run_operator

    lease = (a.lease_namespace, a.lease_seconds) if a.leader_election else None
    code = run_operator(a.image, a.namespace, a.resync_seconds, a.liveness, a.metrics_port, lease)
    # No interpreter teardown: the leader election's daemon thread may be writing a log line,
    # and a daemon thread holding stderr's lock at teardown aborts the process (SIGABRT).
    exit_process(code)


def cmd_validate(a: argparse.Namespace) -> int:
    p = load_pipeline(a.pipeline)
    print(f"{a.pipeline}: ok ({p.name}: {', '.join(s.name for s in p.spec.stages)})")
    return 0


def _bench_dir() -> Path:
    import omni_pipeline

    return Path(omni_pipeline.__file__).resolve().parents[1] / "bench"


def _benchmarks() -> list[str]:
    """Benchmark names: each module of bench/ with a `main` (the others are its helpers), spelled
    with hyphens (`qwen-omni`); `_bench_name` takes the module's own spelling too."""
    return sorted(_bench_name(p.stem) for p in _bench_dir().glob("*.py") if "\ndef main(" in p.read_text())


def _bench_name(name: str) -> str:
    return name.replace("_", "-")


def cmd_bench(a: argparse.Namespace) -> int:
    """Run the benchmark's `main` in this process, as `python -m bench.NAME` would. The
    pipelines it serves are forked (omni_cli.forked) from a fork server forked from this process
    first, before any thread: each has for nothing what this process has imported (all of it,
    where the tests fork this command from their server), where a fresh `omni serve` spent 5-6 s
    of CPU importing it again."""
    if not a.name:
        print("omni bench: no benchmarks here: they run from a source checkout", file=sys.stderr)
        return 2
    root = str(_bench_dir().parent)
    sys.path.insert(0, root)
    # The benchmark's own children (vLLM's CLI, the references) import it as `python -m` had it.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    start_fork_server([])
    module = f"bench.{a.name.replace('-', '_')}"
    sys.argv = [f"omni bench {a.name}", *a.args]
    try:
        importlib.import_module(module).main(a.args)
    finally:  # stopped and reaped here: left to see this process end, it ends an orphan
        stop_fork_server()
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="omni", description="Serve multi-stage omni-modality pipelines.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the whole pipeline on this machine")
    s.add_argument("pipeline")
    s.add_argument("--port", type=int, default=None, help="gateway port (default: spec.gateway.port)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument(
        "--nats", default=None, help=f"NATS URL (default: {NATS_URL_ENV}, spec.nats.url, or embedded)"
    )
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("stage", help="run one replica of one stage")
    s.add_argument("--pipeline", required=True)
    s.add_argument("--stage", required=True)
    s.add_argument("--replica-id", default="0")
    s.add_argument("--nats", default=None)
    s.add_argument("--metrics-host", default="0.0.0.0")
    s.add_argument("--metrics-port", type=int, default=0, help="health and metrics port (0: any free)")
    s.set_defaults(fn=cmd_stage)

    s = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    s.add_argument("--pipeline", required=True)
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--nats", default=None)
    s.set_defaults(fn=cmd_gateway)

    s = sub.add_parser("models", help="model helpers")
    msub = s.add_subparsers(dest="models_cmd", required=True)
    m = msub.add_parser("init-demo", help="build the tiny random-weight demo models offline")
    m.add_argument("dir")
    m.set_defaults(fn=cmd_init_demo)
    m = msub.add_parser(
        "init-config-only",
        help="a real-sized checkpoint without weights (Qwen3-Omni-30B-A3B's, Qwen2.5-Omni-7B's, "
        "Qwen3-TTS-12Hz's), served with loadFormat: dummy",
    )
    m.add_argument(
        "model",
        help=f"one of {', '.join(REAL_SIZED)}",
    )
    m.add_argument("dir")
    m.set_defaults(fn=cmd_init_config_only)
    m = msub.add_parser(
        "init-random",
        help="the same checkpoint with random weights, written as the released files are (safetensors "
        "shards): what loadFormat: dummy builds, read from disk by the real loading code (tens of GB)",
    )
    m.add_argument("model", help="as init-config-only's")
    m.add_argument("dir")
    m.add_argument(
        "--device", default="cpu", help="where the weights are built (cuda: quicker, and as much memory)"
    )
    m.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    m.add_argument(
        "--max-shard-size", default="5GB", help="the Omni models' shards (as transformers' save_pretrained)"
    )
    m.set_defaults(fn=cmd_init_random)

    s = sub.add_parser("crd", help="print the OmniPipeline CustomResourceDefinition (YAML)")
    s.set_defaults(fn=cmd_crd)

    s = sub.add_parser("render", help="print the Kubernetes objects that serve a pipeline (YAML)")
    s.add_argument("pipeline")
    s.add_argument("--namespace", default="default")
    s.add_argument(
        "--image", default=None, help="container image (default: spec.image, else the release image)"
    )
    s.set_defaults(fn=cmd_render)

    s = sub.add_parser("operator", help="run the Kubernetes operator for OmniPipeline resources")
    s.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: every namespace)",
    )
    s.add_argument("--image", default=None, help="image for pipeline pods without spec.image")
    s.add_argument("--resync-seconds", type=float, default=None, help="re-apply every pipeline this often")
    s.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    s.add_argument(
        "--metrics-port", type=int, default=None, help="serve the operator's own /metrics here (default: off)"
    )
    s.add_argument(
        "--leader-election",
        action="store_true",
        help="run only while holding the Lease omni-operator (several replicas: one leads, the others wait)",
    )
    s.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or "default",
        help="namespace of the Lease (default: $POD_NAMESPACE, else default)",
    )
    s.add_argument(
        "--lease-seconds", type=int, default=10, help="a leader silent this long is replaced (default 10)"
    )
    s.set_defaults(fn=cmd_operator)

    s = sub.add_parser(
        "bench",
        help="run a benchmark: our path and its baseline in the same run (see docs/benchmarks.md)",
        description="Each benchmark prints a table, then its JSON object as the last line.",
    )
    names = _benchmarks()
    s.add_argument("name", type=_bench_name, choices=names, nargs=None if names else "?")
    s.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own: --json, --out DIR, ...")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("run-batch", help="run a file of requests to a file of results (as vllm run-batch)")
    s.add_argument(
        "-i", "--input-file", required=True, type=Path, help="requests, OpenAI's batch input JSONL"
    )
    s.add_argument(
        "-o", "--output-file", required=True, type=Path, help="results, OpenAI's batch output JSONL"
    )
    s.add_argument("pipeline", type=Path)
    s.set_defaults(fn=cmd_run_batch)

    s = sub.add_parser("validate", help="check a pipeline file")
    s.add_argument("pipeline")
    s.set_defaults(fn=cmd_validate)
    return ap


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    a = parser().parse_args(argv)
    try:
        return int(a.fn(a))
    except (SpecError, ControlError, ConnectorError) as exc:
        print(f"omni: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

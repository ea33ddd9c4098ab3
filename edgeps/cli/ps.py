"""``edgeps ps``: the parameter server of one job, against a broker."""

from __future__ import annotations

import argparse
import logging
import os
import re
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from edgeps.cli.common import Subparsers, address, broker_args, job_args, stop_on_signals, writable
from ps_service.config import PROCESS_DEFAULTS

if TYPE_CHECKING:
    from edgeps.task import Task
    from learning.model import Params
    from learning.spec import ModelSpec
    from ps_service.config import ServerConfig
    from ps_service.io.prometheus import MetricsEndpoint
    from ps_service.server.core import ServerCore


def cmd_ps(args: argparse.Namespace) -> int:
    """The composition root of the server: the job's options and task, its core, the checkpoint, the
    metrics endpoint and the broker, served until the job ends; then the models and the report."""
    from ps_service.io.mqtt import connect_server, serve

    for path, flag in ((args.save_model, "--save-model"), (args.report, "--report"), (args.checkpoint, "--checkpoint")):
        writable(path, flag)  # a job's result is never lost to a missing folder after it trained
    task, config, model = _job(args)
    core = _core(args, task, config)
    checkpoint, key = _checkpoint(args)
    stop = stop_on_signals()
    endpoint = _endpoint(args, config.job)
    transport = connect_server(core, address(args))
    shapes = {name: list(values.shape) for name, values in core.store.params().items()}
    where = f"task {args.task}" if args.task else "built-in model"
    metrics, log = ",".join(config.metric_names), logging.getLogger("edgeps")
    log.info(
        "parameter server for job %s on %s, %s, model %s, loss %s, metrics %s, pace %s",
        *(args.job, args.broker, where, shapes, config.loss, metrics, config.pace),
    )
    started = time.monotonic()
    try:
        serve(core, transport, stop=stop, checkpoint=checkpoint, endpoint=endpoint, checkpoint_key=key)
    finally:
        transport.close(end_session=core.finished)  # a finished job's session is of no more use
    if args.save_model:  # the final and the best model, each with its card (edgeps.deploy reads them)
        save_models(task, core, Path(args.save_model))
    if args.report:  # the same report as the demo's: edgeps report FILE shows it again
        from edgeps.report import build_report, write_json

        settings = {"server": config.model_dump(mode="json"), "model": model.model_dump(), "seed": args.seed}
        settings["task"] = args.task
        write_json(build_report(core.history, time.monotonic() - started, settings), args.report)
    return 0


def _job(args: argparse.Namespace) -> tuple[Task, ServerConfig, ModelSpec]:
    """The job's options, from flags, file and environment and the task file's, refused before
    anything starts; the task (the built-in one without ``--task``) and the model's options."""
    from edgeps.options import model_values
    from edgeps.task import builtin_task, load_task
    from learning.losses import LOSSES
    from learning.spec import ModelSpec
    from ps_service.config import ServerConfig

    values = model_values(ServerConfig, args)
    task = load_task(args.task) if args.task else None
    if task is not None:
        values |= task.server_options()
    elif values.get("loss", "cross_entropy") not in LOSSES:
        builtin = ", ".join(LOSSES)
        raise ValueError(f"--loss {values['loss']}: not a built-in loss ({builtin}); a task file brings its own")
    config = ServerConfig(**values)
    model = ModelSpec(**model_values(ModelSpec, args))
    return task or builtin_task(model, config.loss, config.metric_names), config, model


def _core(args: argparse.Namespace, task: Task, config: ServerConfig) -> ServerCore:
    """The server core: the held-out data and its evaluator, the model's first parameters and, with
    ``--artifact`` or ``--export-tflite``, the devices' TFLite trainer."""
    from learning.data import load_npz
    from ps_service.evaluator import Evaluator
    from ps_service.server.core import ServerCore

    holdout = load_npz(args.eval_data, task.classification) if args.eval_data else task.holdout(args.seed)
    params = task.init(holdout, args.seed)
    artifact = _artifact(args, task, params, config.loss, holdout.x.shape[1])
    evaluator = Evaluator(
        holdout,
        args.eval_sample,
        args.seed,
        clock=time.perf_counter,
        loss=config.loss,
        metrics=config.metric_names,
        predict=task.predict,
        loss_value=task.loss_value(),
        target=task.target,
    )
    return ServerCore(config, params, evaluator, artifact=artifact, columns=task.columns())


def _artifact(args: argparse.Namespace, task: Task, params: Params, loss: str, features: int) -> bytes | None:
    """The devices' TFLite trainer: a prebuilt one (checked), or built from the model, or none."""
    if args.artifact:
        from schemas.artifact import decode_artifact

        artifact = Path(args.artifact).read_bytes()
        decode_artifact(artifact)  # refuse a broken file before any device sees it
        return artifact
    if not args.export_tflite:
        return None
    from edge_client.trainer import Trainer
    from ps_service.export import build_artifact

    if isinstance(task.model, Trainer):
        raise ValueError(
            "--export-tflite: a task's own trainer has no TFLite export (its devices run "
            "edgeps client --task with the numpy backend; docs/TASKS.md)"
        )
    return build_artifact(params, args.batch_size, loss=loss, features=features)


def _checkpoint(args: argparse.Namespace) -> tuple[Path | None, bytes | None]:
    """The checkpoint's path and key (read once, here); a damaged or forged checkpoint is refused
    before anything connects."""
    if not args.checkpoint:
        return None, None
    from ps_service.io.checkpoint import decode

    checkpoint = Path(args.checkpoint)
    key = checkpoint_key(args.checkpoint_key_file, checkpoint, os.environ.get("EDGEPS_CHECKPOINT_KEY"))
    if checkpoint.exists():
        decode(checkpoint.read_bytes(), key)
    return checkpoint, key


def _endpoint(args: argparse.Namespace, job: str) -> MetricsEndpoint | None:
    """``/metrics`` and the dashboard with ``--metrics-port``; its address logged."""
    if args.metrics_port is None:
        return None
    from ps_service.io.prometheus import MetricsEndpoint

    try:
        tls = (args.metrics_tls_cert, args.metrics_tls_key)
        ws = args.dashboard_broker or f"ws://{address(args).host}:9001"  # `edgeps broker`'s default listener
        page = {"job": job, "broker": ws}
        endpoint = MetricsEndpoint(args.metrics_port, args.metrics_host, *tls, page=page)
    except (OSError, OverflowError) as exc:  # in use, not ours to open, out of range
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"--metrics-port {args.metrics_port} on {args.metrics_host}: {why}") from None
    where = f"{endpoint.scheme}://{args.metrics_host}:{endpoint.port}"
    page_url = f"{where}/?{urllib.parse.urlencode(page)}"
    page_text = f"the dashboard on {page_url}" if endpoint.dashboard else "no dashboard (off loopback: HTTPS only)"
    logging.getLogger("edgeps").info("Prometheus metrics on %s/metrics; %s", where, page_text)
    return endpoint


def save_models(task: Task, core: ServerCore, path: Path) -> None:
    """The final model at ``path`` and the best version by the job's metric beside it (``-best``)."""
    from edgeps.deploy import best_path

    log, metric = logging.getLogger("edgeps"), core.evaluator.metric.name
    final, best = core.store.version, core.report.best
    where = ", ".join(str(p) for p in task.save_model(core.store.params(), path, task.card(final)))
    log.info("final model (version %d) saved to %s", final, where)
    if best is not None:
        where = ", ".join(str(p) for p in task.save_model(best.params, best_path(path), task.card(best.version)))
        value = best.evaluation.values[metric]
        log.info("best model (version %d, %s %.4f) saved to %s", best.version, metric, value, where)


def checkpoint_key(path: str | None, checkpoint: Path, environ_key: str | None) -> bytes:
    """The checkpoint's key: from ``EDGEPS_CHECKPOINT_KEY`` (hex), else from its file (``path``, default
    CHECKPOINT.key, made on first use). A key given where a file is named is refused, unread: a command
    line is visible to every user of the machine."""
    from ps_service.io.checkpoint import CheckpointError, load_key, parse_key
    from ps_service.io.mqtt import default_key_path

    if environ_key:
        return parse_key(environ_key, "EDGEPS_CHECKPOINT_KEY")
    if path is not None and not Path(path).exists() and re.fullmatch(r"[0-9a-fA-F]{32,}", path):
        raise CheckpointError(
            "--checkpoint-key-file names a file; give the key itself in EDGEPS_CHECKPOINT_KEY, "
            "not on the command line (every user of the machine can read it there)"
        )
    key_path = Path(path) if path else default_key_path(checkpoint)
    return load_key(key_path, create=not checkpoint.exists())


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options and its function."""
    ps = sub.add_parser("ps", help="run the parameter server against a broker")
    broker_args(ps)
    job_args(ps, **PROCESS_DEFAULTS)
    ps.add_argument("--seed", type=int, default=0, help="seed of the model's initial parameters (default: 0)")
    ps.add_argument("--task", help="a task file: the model, loss, metrics and data (docs/TASKS.md)")
    ps.add_argument("--eval-data", help="held-out .npz (x, y); default: the task's, or digits' 20%% stratified split")
    ps.add_argument("--report", help="write the job's report here as JSON when it ends (edgeps report shows it)")
    ps.add_argument(
        "--save-model",
        help="write the final model here when the job ends (.npz, by tensor name; "
        "a Keras task also .keras and .tflite beside it)",
    )
    ps.add_argument("--export-tflite", action="store_true", help="build the devices' TFLite trainer (tf extra)")
    ps.add_argument("--artifact", help="publish this prebuilt model artifact file instead")
    ps.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (/metrics)")
    ps.add_argument("--metrics-host", default="127.0.0.1", help="address of the Prometheus endpoint")
    ps.add_argument(
        "--dashboard-broker",
        help="the broker's MQTT-over-WebSockets URL the dashboard connects to "
        "(default: ws://BROKER-HOST:9001, the listener of `edgeps broker`)",
    )
    ps.add_argument("--metrics-tls-cert", help="serve the endpoint over HTTPS with this certificate (PEM)")
    ps.add_argument("--metrics-tls-key", help="the certificate's key (PEM)")
    ps.add_argument("--checkpoint", help="keep the server's state here (atomically); resume from it if it exists")
    ps.add_argument(
        "--checkpoint-key-file",
        "--checkpoint-key",
        dest="checkpoint_key_file",
        help="the file holding the key (hex) that signs the checkpoint; default CHECKPOINT.key, made on "
        "first use; or the key itself in EDGEPS_CHECKPOINT_KEY (never on the command line)",
    )
    ps.set_defaults(func=cmd_ps)

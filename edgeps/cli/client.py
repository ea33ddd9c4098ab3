"""``edgeps client``: one edge device (the numpy or TFLite trainer), against a broker."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from edgeps.cli.common import Subparsers, address, broker_args, stop_on_signals


def cmd_client(args: argparse.Namespace) -> int:
    from edge_client.backend import make_trainer
    from edge_client.config import DeviceConfig
    from edge_client.core import DeviceCore
    from edge_client.mqtt import connect_device, run_device
    from edge_client.profile import DeviceProfile
    from edgeps.options import model_values
    from edgeps.task import load_task
    from learning.data import load_npz

    config = DeviceConfig(**model_values(DeviceConfig, args))
    task = load_task(config.task) if config.task else None
    if not config.device or not (config.data or (task and task.device_data)):
        raise ValueError(
            "a client needs --device and --data (flags, --config file or EDGEPS_DEVICE/EDGEPS_DATA), "
            "or a task file with device_data"
        )
    trainer, artifact_trainer = make_trainer(config.backend, task.loss if task and task.loss_spec else "cross_entropy")
    if task is not None and config.backend != "tflite":
        trainer = task.trainer()
    columns = None  # a task's own CSV rows: the fingerprint of their columns and scaling
    if config.data:
        data = load_npz(config.data, None if task is None else task.classification)
    else:
        assert task is not None
        data, columns = task.device_rows(config.device)
    core = DeviceCore(
        config.job, config.device, data, trainer, seed=config.seed, artifact_trainer=artifact_trainer, columns=columns
    )
    transport = connect_device(core, address(args))
    log = logging.getLogger("edgeps")
    log.info("device %s joined job %s with %d samples", config.device, config.job, len(core.data))
    profile = DeviceProfile(slowdown=config.slowdown, step_s=config.step_time)
    cache = Path(config.cache) if config.cache else None
    run_device(core, transport, profile, stop=stop_on_signals(), cache=cache)
    if core.fatal is not None:
        raise ValueError(f"{config.data or config.device}: {core.fatal}")
    log.info("device %s done: %d commits", config.device, core.seq)
    return 0


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options (DeviceConfig's) and its function."""
    from edge_client.config import DeviceConfig
    from edgeps.options import add_model_options

    client = sub.add_parser("client", help="run one edge device against a broker")
    broker_args(client)
    add_model_options(client, DeviceConfig)
    client.set_defaults(func=cmd_client)

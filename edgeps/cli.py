"""The ``edgeps`` command: demo, ps, client, broker, data."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from broker.client import BrokerAddress
from ps_service.config import PROCESS_DEFAULTS
from ps_service.paces import make_pace


def _broker_args(parser: argparse.ArgumentParser) -> None:
    """Where the broker is and how to log in (each also from EDGEPS_<OPTION>, as every option)."""
    parser.add_argument(
        "--broker", default="127.0.0.1:1883", help="HOST:PORT of the MQTT broker (default: %(default)s)"
    )
    parser.add_argument("--username", help="the account's name")
    parser.add_argument("--password", help="the account's password (better: --password-file)")
    parser.add_argument("--password-file", help="read the password from this file")
    parser.add_argument("--tls-ca", help="CA certificate: use TLS")
    parser.add_argument("--tls-cert", help="client certificate")
    parser.add_argument("--tls-key", help="client certificate's key")


def _job_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), **defaults: object) -> None:
    """The job's options (ServerConfig) and the model's (ModelSpec), derived from them."""
    from edgeps.options import add_model_options
    from learning.spec import ModelSpec
    from ps_service.config import ServerConfig

    add_model_options(parser, ServerConfig, skip=skip, defaults=defaults)
    add_model_options(parser, ModelSpec)


def _address(args: argparse.Namespace) -> BrokerAddress:
    password = args.password
    if args.password_file:
        password = Path(args.password_file).read_text().strip()
    tls = {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key}
    return BrokerAddress.parse(args.broker, args.username, password, **tls)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_ps(args: argparse.Namespace) -> int:
    from edgeps.options import model_values
    from learning.data import Dataset, load_digits, stratified_split
    from learning.spec import ModelSpec
    from ps_service.config import ServerConfig
    from ps_service.core import ServerCore
    from ps_service.evaluator import Evaluator
    from ps_service.mqtt import connect_server, serve
    from schemas.artifact import decode_artifact

    if args.eval_data:
        holdout = Dataset.load(args.eval_data)
    else:
        _, holdout = stratified_split(load_digits(), 0.2, args.seed)
    config = ServerConfig(**model_values(ServerConfig, args))  # refused before anything starts
    model = ModelSpec(**model_values(ModelSpec, args))
    params = model.init(holdout.x.shape[1], holdout.classes, args.seed)
    artifact = None
    if args.artifact:
        artifact = Path(args.artifact).read_bytes()
        decode_artifact(artifact)  # refuse a broken file before any device sees it
    elif args.export_tflite:
        from ps_service.export import build_artifact

        artifact = build_artifact(params, args.batch_size)
    core = ServerCore(config, params, Evaluator(holdout, args.eval_sample, args.seed), artifact=artifact)
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    key = None
    if checkpoint is not None:  # a damaged or forged checkpoint is refused before anything connects
        from ps_service.checkpoint import decode, load_key
        from ps_service.mqtt import default_key_path

        key_path = Path(args.checkpoint_key) if args.checkpoint_key else default_key_path(checkpoint)
        key = load_key(key_path, create=not checkpoint.exists())
        if checkpoint.exists():
            decode(checkpoint.read_bytes(), key)
    stop = _stop_on_signals()
    endpoint = None
    if args.metrics_port is not None:
        from ps_service.prometheus import MetricsEndpoint

        endpoint = MetricsEndpoint(args.metrics_port, args.metrics_host, args.metrics_tls_cert, args.metrics_tls_key)
        where = f"{endpoint.scheme}://{args.metrics_host}:{endpoint.port}"
        page = f"the dashboard on {where}/" if endpoint.dashboard else "no dashboard (off loopback it needs HTTPS)"
        logging.getLogger("edgeps").info("Prometheus metrics on %s/metrics; %s", where, page)
    transport = connect_server(core, _address(args))
    logging.getLogger("edgeps").info(
        "parameter server for job %s on %s, model %s %s, pace %s",
        args.job,
        args.broker,
        model.arch,
        [holdout.x.shape[1], *model.layers, holdout.classes],
        config.pace,
    )
    try:
        serve(core, transport, stop=stop, checkpoint=checkpoint, endpoint=endpoint, checkpoint_key=key)
    finally:
        transport.close()
    if args.report:
        Path(args.report).write_text(json.dumps([m.model_dump() for m in core.history]))
    return 0


def cmd_client(args: argparse.Namespace) -> int:
    from edge_client.core import DeviceCore
    from edge_client.mqtt import connect_device, run_device
    from edge_client.profile import DeviceProfile
    from edge_client.trainer import make_trainer
    from learning.data import Dataset

    if not args.device or not args.data:
        raise ValueError("a client needs --device and --data (flags, --config file or EDGEPS_DEVICE/EDGEPS_DATA)")
    trainer, artifact_trainer = make_trainer(args.backend)
    data = Dataset.load(args.data)
    core = DeviceCore(args.job, args.device, data, trainer, seed=args.seed, artifact_trainer=artifact_trainer)
    transport = connect_device(core, _address(args))
    logging.getLogger("edgeps").info("device %s joined job %s with %d samples", args.device, args.job, len(core.data))
    profile = DeviceProfile(slowdown=args.slowdown, step_s=args.step_time)
    cache = Path(args.cache) if args.cache else None
    run_device(core, transport, profile, stop=_stop_on_signals(), cache=cache)
    logging.getLogger("edgeps").info("device %s done: %d commits", args.device, core.seq)
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    from broker.launcher import start_broker

    if args.action == "init":
        return cmd_broker_init(args)
    broker = start_broker(
        port=args.port,
        host=args.host,
        embedded=True if args.embedded else None,
        workdir=Path(args.data_dir),
        ws_port=args.ws_port,
    )
    print(f"{broker.kind} listening on {', '.join(broker.listeners)}; data and log in {broker.workdir}; "
          "Ctrl-C stops it")  # fmt: skip
    stop = _stop_on_signals()
    try:
        while not stop.wait(0.5) and broker.process.poll() is None:
            pass
    finally:
        broker.stop()
    return 0


def cmd_broker_init(args: argparse.Namespace) -> int:
    from broker.secure import init_secure_broker

    if not args.directory or not args.devices:
        raise ValueError("edgeps broker init DIR --devices dev-00,dev-01,... [--job J] [--operators op]")
    setup = init_secure_broker(
        Path(args.directory),
        job=args.job,
        devices=args.devices.split(","),
        operators=args.operators.split(","),
        server=args.server,
        port=args.port if args.port != 1883 else 8883,
        host=args.host if args.host != "127.0.0.1" else "0.0.0.0",
        hostnames=tuple(args.hostnames.split(",")),
        client_certs=args.client_certs,
    )
    d, creds = setup.directory, setup.credentials_dir
    print(f"wrote {d}/broker (the broker's: config, passwd, acl, certificate, data), {d}/ca (the CA key: keep it "
          f"offline) and {d}/credentials (each account's password, ca.crt) for job {args.job}")  # fmt: skip
    owned = setup.broker_dir.owner() == "mosquitto"
    owner = "owned by the mosquitto account" if owned else "chown -R it to the broker's account if it runs as one"
    print(f"start the broker:  mosquitto -c {setup.config}   ({d}/broker: {owner})")
    password = creds / f"{setup.server}.password"
    print(f"server:   edgeps ps --broker HOST:PORT --username {setup.server} --password-file {password} "
          f"--tls-ca {setup.ca_cert} --devices {','.join(setup.devices)} ...")  # fmt: skip
    print(f"a device: edgeps client --broker HOST:PORT --username DEVICE --password-file {creds}/DEVICE.password "
          f"--tls-ca {setup.ca_cert} --device DEVICE ...")  # fmt: skip
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from learning.data import load_digits, load_idx
    from learning.prepare import prepare_shards

    data = load_idx(args.idx_images, args.idx_labels) if args.idx_images else load_digits()
    paths = prepare_shards(data, Path(args.out), args.devices, args.alpha, args.seed)
    print(f"wrote {paths.holdout} and {len(paths.devices)} device shards under {args.out}")
    if args.format == "frame":  # what the C device (edgeps-device) reads, beside each .npz
        from learning.data import Dataset
        from schemas.frame import encode_data_frame

        for shard in paths.devices:
            data = Dataset.load(shard)
            shard.with_suffix(".epsf").write_bytes(encode_data_frame(data.x, data.y))
        print("and a data frame (.epsf) beside each device shard, for edgeps-device")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from edgeps.demo import DemoSettings, run_demo
    from edgeps.options import model_values
    from learning.spec import ModelSpec
    from ps_service.config import ServerConfig

    server = ServerConfig(**model_values(ServerConfig, args))
    model = ModelSpec(**model_values(ModelSpec, args))
    settings = DemoSettings(server=server, model=model, **model_values(DemoSettings, args, skip=DEMO_API_ONLY))
    report = run_demo(settings, json_path=args.json)
    return 0 if report["rounds"] > 0 else 1


#: DemoSettings fields that are not flags of ``edgeps demo`` (the job and model have their own; the
#: rest are for benches that emulate device classes).
DEMO_API_ONLY = ("server", "model", "timeout_s", "slowdowns", "step_time")


def cmd_bench_pace(args: argparse.Namespace) -> int:
    from edgeps.bench.common import real_scenario, replace_scenario
    from edgeps.bench.pace import DEFAULT_PACES, run_bench_pace
    from edgeps.simulator import Scenario
    from schemas.codecs import make_codec

    if not args.verbose:  # the table and the progress lines say it all
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    base = real_scenario(Scenario()) if args.real else Scenario()
    changes = {
        "devices": args.devices,
        "slow_fraction": args.slow_fraction,
        "slowdown": args.slowdown,
        "alpha": args.alpha,
        "target": args.target,
        "seed": args.seed,
        "duration_s": args.duration,
        "push_every": args.push_every,
        "lr": args.lr,
        "pull_codec": args.pull_codec,
        "extrapolation": args.extrapolation,
    }
    scenario = replace_scenario(base, **{k: v for k, v in changes.items() if v is not None})
    if args.codec and args.real:
        raise ValueError("--codec sweeps run in the simulator; drop --real")
    default = ("acbsp",) if args.codec else ("bsp", "acbsp") if args.real else DEFAULT_PACES
    paces = args.paces.split(",") if args.paces else list(default)
    for pace in paces:
        make_pace(pace)  # fail before running anything
    for spec in args.codec or []:
        for codec in spec.split("/"):
            make_codec(codec)
    out = Path(args.out) if args.out else None
    if args.seeds > 1 and (args.real or args.codec):
        raise ValueError("--seeds runs the default comparison in the simulator; drop --real and --codec")
    run_bench_pace(scenario, paces, args.real, args.json, Path(args.plot), out, codecs=args.codec, seeds=args.seeds)
    return 0


def cmd_bench_freq(args: argparse.Namespace) -> int:
    from edgeps.bench.common import replace_scenario
    from edgeps.bench.freq import run_bench_freq
    from edgeps.simulator import Scenario

    if not args.verbose:
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    changes = {
        "seed": args.seed,
        "duration_s": args.duration,
        "push_every": args.push_every,
        "push_every_min": args.push_every_min,
        "push_every_max": args.push_every_max,
        "target": args.target,
    }
    scenario = replace_scenario(Scenario(), **{k: v for k, v in changes.items() if v is not None})
    run_bench_freq(scenario, args.json, Path(args.plot))
    return 0


def cmd_bench_footprint(args: argparse.Namespace) -> int:
    from edgeps.bench.footprint import bench_footprint, format_footprint

    if not args.verbose:
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    report = bench_footprint(rounds=args.rounds)
    print()
    print(format_footprint(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def cmd_ctl(args: argparse.Namespace) -> int:
    """Operator commands on the job's command topic, and a live view of its metrics (edgeps.operator)."""
    from edgeps.operator import request, watch

    if args.action == "watch":
        for m in watch(_address(args), args.job, _stop_on_signals()):
            push = sorted(set(m.push_every.values()))
            print(f"v{m.version:>6}  acc {m.accuracy:.4f}  loss {m.loss:.4f}  commits {m.commits:>7}  "
                  f"applied {m.applied:>7}  rejected {sum(m.rejected.values()):>5}  online {m.devices_online:>4}  "
                  f"push_every {push}  {m.elapsed_s:8.1f} s", flush=True)  # fmt: skip
        return 0
    fields: dict = {"cmd": args.action.replace("-", "_"), "reason": args.reason}
    if args.action in ("set-codec", "set-pace", "evict"):
        if not args.value:
            raise ValueError(f"{args.action} needs a value: edgeps ctl {args.action} VALUE")
        fields[{"set-codec": "codec", "set-pace": "pace", "evict": "device"}[args.action]] = args.value
    if args.action == "set-frequency":
        fields |= {"policy": args.policy, "low": args.low, "high": args.high}
    try:
        reply = request(_address(args), args.job, fields, args.timeout)
    except TimeoutError as exc:
        raise ConnectionError(str(exc)) from None
    if reply.status is not None:
        print(json.dumps(reply.status, indent=2))
    else:
        print(f"{'ok' if reply.ok else 'refused'}: {reply.cmd}: {reply.detail}")
    return 0 if reply.ok else 1


def cmd_bench_load(args: argparse.Namespace) -> int:
    from edgeps.bench.load import run_bench_load

    if not args.verbose:
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    report = run_bench_load(args.devices, args.seconds, args.rate, args.flood, args.json)
    return 0 if report["balanced"] else 1


def cmd_bench_attack(args: argparse.Namespace) -> int:
    from edgeps.bench.attack import run_bench_attack

    if not args.verbose:
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    floods = tuple(int(float(x.rstrip("kKmM")) * {"k": 1 << 10, "m": 1 << 20}.get(x[-1].lower(), 1))
                   for x in args.flood.split(",") if x)  # fmt: skip
    run_bench_attack(args.rounds, args.round_deadline, floods, args.json)
    return 0


def cmd_bench_restart(args: argparse.Namespace) -> int:
    from edgeps.bench.restart import run_bench_restart

    if not args.verbose:
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    run_bench_restart(args.trials, args.signal, args.round_deadline, args.json)
    return 0


def cmd_bench_embedded(args: argparse.Namespace) -> int:
    from edgeps.bench.embedded import run_bench_embedded

    if not args.verbose:
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    report = run_bench_embedded(args.rounds, args.devices, args.json)
    return 0 if report["qemu_ok"] else 1


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from edgeps.bench.codec import bench_codecs
    from schemas.codecs import make_codec

    specs = args.codecs.split(",")
    for spec in specs:
        make_codec(spec)  # fail before measuring anything
    sizes = [int(float(s.rstrip("Mm")) * (1 << 20)) if s[-1] in "Mm" else int(s) for s in args.sizes.split(",")]
    report = bench_codecs(specs, sizes, repeats=args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgeps", description="MQTT parameter-server training for edge devices")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="broker + server + N devices on loopback; prints a report")
    _job_args(demo, skip=("allowed_devices", "min_devices"), **PROCESS_DEFAULTS)
    from edgeps.demo import DemoSettings
    from edgeps.options import add_model_options

    add_model_options(demo, DemoSettings, skip=DEMO_API_ONLY)
    demo.add_argument("--json", help="also write the report as JSON here")
    demo.set_defaults(func=cmd_demo)

    ps = sub.add_parser("ps", help="run the parameter server against a broker")
    _broker_args(ps)
    _job_args(ps, **PROCESS_DEFAULTS)
    ps.add_argument("--seed", type=int, default=0, help="seed of the model's initial parameters (default: 0)")
    ps.add_argument("--eval-data", help="held-out .npz (x, y); default: digits' 20%% stratified split")
    ps.add_argument("--report", help="write the per-version metrics here as JSON when the job ends")
    ps.add_argument("--export-tflite", action="store_true", help="build the devices' TFLite trainer (tf extra)")
    ps.add_argument("--artifact", help="publish this prebuilt model artifact file instead")
    ps.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (/metrics)")
    ps.add_argument("--metrics-host", default="127.0.0.1", help="address of the Prometheus endpoint")
    ps.add_argument("--metrics-tls-cert", help="serve the endpoint over HTTPS with this certificate (PEM)")
    ps.add_argument("--metrics-tls-key", help="the certificate's key (PEM)")
    ps.add_argument("--checkpoint", help="keep the server's state here (atomically); resume from it if it exists")
    ps.add_argument(
        "--checkpoint-key", help="the key that signs the checkpoint (hex); default CHECKPOINT.key, made on first use"
    )
    ps.set_defaults(func=cmd_ps)

    client = sub.add_parser("client", help="run one edge device against a broker")
    _broker_args(client)
    client.add_argument("--job", default="demo")
    client.add_argument("--device", help="device id (also its MQTT topic segment); required")
    client.add_argument("--data", help="the device's training shard, .npz with x and y; required")
    client.add_argument(
        "--backend",
        default="numpy",
        choices=["numpy", "tflite", "auto"],
        help="numpy; tflite: the server's TFLite trainer (needs ai-edge-litert or tflite-runtime); "
        "auto: numpy until a runnable artifact arrives",
    )
    client.add_argument("--cache", help="directory for verified model artifacts (tflite/auto)")
    client.add_argument("--slowdown", type=float, default=1.0, help="emulate a device this many times slower")
    client.add_argument("--step-time", type=float, default=0.0, help="emulated compute seconds per local step")
    client.add_argument("--seed", type=int, default=0)
    client.set_defaults(func=cmd_client)

    broker = sub.add_parser("broker", help="start Mosquitto with the project's config (or the embedded broker)")
    broker.add_argument("--host", default="127.0.0.1")
    broker.add_argument("--port", type=int, default=1883)
    broker.add_argument("--embedded", action="store_true", help="force the embedded amqtt broker")
    broker.add_argument("--ws-port", type=int, default=9001, help="MQTT over WebSockets (the dashboard), on --host")
    broker.add_argument(
        "--data-dir", default="edgeps-broker", help="persistence (sessions, queued and retained messages) and log"
    )
    broker.add_argument("action", nargs="?", default="run", choices=["run", "init"], help="init DIR: write a "
                        "deployable setup (accounts, ACLs, TLS) instead of starting the local broker")  # fmt: skip
    broker.add_argument("directory", nargs="?", help="init: where to write it")
    broker.add_argument("--job", default="demo", help="init: the job the accounts are for")
    broker.add_argument("--devices", help="init: comma-separated device ids (one account each)")
    broker.add_argument("--operators", default="operator", help="init: comma-separated operator accounts")
    broker.add_argument("--server", default="ps", help="init: the parameter server's account")
    broker.add_argument("--hostnames", default="localhost,127.0.0.1", help="init: names in the broker's certificate")
    broker.add_argument("--client-certs", action="store_true", help="init: issue and require client certificates")
    broker.set_defaults(func=cmd_broker)

    ctl = sub.add_parser("ctl", help="operator: send a command to a job, or watch its metrics")
    _broker_args(ctl)
    ctl.add_argument(
        "action",
        choices=["status", "pause", "resume", "stop", "set-pace", "set-codec", "set-frequency", "freeze-frequency",
                 "unfreeze-frequency", "evict", "watch"],
    )  # fmt: skip
    ctl.add_argument(
        "value", nargs="?", help="set-codec: the codec (sign); set-pace: the pace (acbsp); evict: the device"
    )
    ctl.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server's reply")
    ctl.add_argument("--job", default="demo")
    ctl.add_argument("--policy", help="set-frequency: fixed, adacomm or trend")
    ctl.add_argument("--low", type=int, help="set-frequency: lowest push_every")
    ctl.add_argument("--high", type=int, help="set-frequency: highest push_every")
    ctl.add_argument("--reason", default="", help="recorded in the server's log")
    ctl.set_defaults(func=cmd_ctl)

    for role in LAYERED:
        _roles(parser)[role].add_argument("--config", help="a TOML file of this role's options (docs: edgeps config)")
    config = sub.add_parser("config", help="show a role's effective configuration (file, environment, flags)")
    config.add_argument("what", choices=["show"])
    config.add_argument("role", help=f"one of {', '.join(LAYERED)}")
    config.add_argument("rest", nargs=argparse.REMAINDER, help="--config FILE and flags, as the role takes them")
    config.set_defaults(func=cmd_config)

    bench = sub.add_parser("bench", help="measurements").add_subparsers(dest="bench", required=True)
    pace = bench.add_parser("pace", help="compare paces on one scenario (simulated, or --real over Mosquitto)")
    pace.add_argument("--real", action="store_true", help="real processes over a Mosquitto it starts (wall time)")
    pace.add_argument("--paces", help="comma-separated, default bsp,acbsp,asp,ssp:2 (real: bsp,acbsp)")
    pace.add_argument("--devices", type=int, help="default 16 (real: 8)")
    pace.add_argument("--slow-fraction", type=float, help="share of slow devices, default 0.25")
    pace.add_argument("--slowdown", type=float, help="slow devices' compute factor, default 4")
    pace.add_argument("--alpha", type=float, help="Dirichlet non-IID concentration, default 0.5")
    pace.add_argument("--target", type=float, help="target accuracy, default 0.90")
    pace.add_argument("--duration", type=float, help="seconds per run (virtual; real: wall), default 30 (real: 12)")
    pace.add_argument("--push-every", type=int)
    pace.add_argument("--lr", type=float)
    pace.add_argument("--seed", type=int)
    pace.add_argument("--seeds", type=int, default=1, help="run every pace on this many seeds from --seed; print means")
    pace.add_argument("--extrapolation", type=float, help="FedExP cap for every pace (default: each pace's own)")
    pace.add_argument(
        "--codec",
        action="append",
        help="PUSH or PUSH/PULL codecs to sweep (repeatable; default pace then acbsp), e.g. sign or fp32/ternary",
    )
    pace.add_argument("--pull-codec", help="parameter deltas in this codec for every run (default: fp32 snapshots)")
    pace.add_argument("--json", help="write the report as JSON here")
    pace.add_argument("--plot", default="bench-pace.png", help="PNG of accuracy against time")
    pace.add_argument("--out", help="real runs: keep data, logs and broker files here")
    pace.set_defaults(func=cmd_bench_pace)

    freq = bench.add_parser("freq", help="push_every policies fixed, adacomm and trend on the pace scenario (acbsp)")
    freq.add_argument("--seed", type=int)
    freq.add_argument("--duration", type=float, help="virtual seconds per run, default 30")
    freq.add_argument("--target", type=float, help="target accuracy, default 0.90")
    freq.add_argument("--push-every", type=int, help="fixed's push_every, default 10")
    freq.add_argument("--push-every-min", type=int, help="adacomm/trend lower bound, default 1")
    freq.add_argument("--push-every-max", type=int, help="adacomm/trend upper bound, default 160")
    freq.add_argument("--json", help="write the report as JSON here")
    freq.add_argument("--plot", default="bench-freq.png", help="PNG of accuracy and push_every against time")
    freq.set_defaults(func=cmd_bench_freq)

    footprint = bench.add_parser("footprint", help="a fresh device install: size on disk, client peak RSS per backend")
    footprint.add_argument("--rounds", type=int, default=20, help="versions in each client's job")
    footprint.add_argument("--json", help="write the report as JSON here")
    footprint.set_defaults(func=cmd_bench_footprint)

    load = bench.add_parser("load", help="N device clients over one Mosquitto against a real server, for S seconds")
    load.add_argument("--devices", type=int, default=200)
    load.add_argument("--seconds", type=float, default=60.0)
    load.add_argument("--rate", type=float, default=1.0, help="commits per second per device")
    load.add_argument("--flood", action="store_true", help="one device sends 250 commits/s (rate limiting)")
    load.add_argument("--json", help="write the report as JSON here")
    load.set_defaults(func=cmd_bench_load)

    attack = bench.add_parser("attack", help="a job with one of three devices hostile, beside a clean one (TLS broker)")
    attack.add_argument("--rounds", type=int, default=100, help="bsp versions in each job")
    attack.add_argument("--round-deadline", type=float, default=2.0, help="the jobs' round deadline, seconds")
    attack.add_argument("--flood", default="", help="also: the third device floods junk commits of these sizes, "
                        "e.g. 100,8M")  # fmt: skip
    attack.add_argument("--json", help="write the report as JSON here")
    attack.set_defaults(func=cmd_bench_attack)

    restart = bench.add_parser("restart", help="a job whose server, then one of whose devices, restarts N times")
    restart.add_argument("--trials", type=int, default=10, help="restarts in each job")
    restart.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGKILL"], help="how the server stops")
    restart.add_argument("--round-deadline", type=float, default=10.0, help="the jobs' round deadline, seconds")
    restart.add_argument("--json", help="write the report as JSON here")
    restart.set_defaults(func=cmd_bench_restart)

    embedded = bench.add_parser("embedded", help="the C device SDK: Cortex-M4F flash/RAM, QEMU, a job of C devices")
    embedded.add_argument("--rounds", type=int, default=100, help="bsp versions in each real job")
    embedded.add_argument("--devices", type=int, default=8, help="device processes in each real job")
    embedded.add_argument("--json", help="write the report as JSON here")
    embedded.set_defaults(func=cmd_bench_embedded)

    codec = bench.add_parser("codec", help="compression ratio, error and speed of every codec against numpy's copy")
    codec.add_argument("--codecs", default="fp32,fp16,int8,sign,ternary,qsgd:16,topk:0.01")
    codec.add_argument("--sizes", default="1M,4M", help="tensor sizes in float32 values (M = 2**20)")
    codec.add_argument("--repeats", type=int, default=9, help="timings per measurement; the fastest counts")
    codec.add_argument("--json", help="write the report as JSON here")
    codec.set_defaults(func=cmd_bench_codec)

    data = sub.add_parser("data", help="write a held-out set and non-IID device shards")
    data.add_argument("--out", required=True)
    data.add_argument("--devices", type=int, default=8)
    data.add_argument("--alpha", type=float, default=0.5)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--idx-images", help="MNIST-format images file (default dataset: digits)")
    data.add_argument("--idx-labels", help="MNIST-format labels file")
    data.add_argument("--format", choices=["npz", "frame"], default="npz",
                      help="frame: also a .epsf data frame per device, for the C device (edgeps-device)")  # fmt: skip
    data.set_defaults(func=cmd_data)
    return parser


LAYERED = ("demo", "ps", "client", "ctl", "broker")  # roles that read --config and EDGEPS_* variables


def _roles(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def cmd_config(args: argparse.Namespace) -> int:
    from edgeps.settings import show

    role = _roles(build_parser()).get(args.role)
    if args.role not in LAYERED or role is None:
        raise ValueError(f"config show takes one of {', '.join(LAYERED)}")
    config = None
    rest = list(args.rest)
    if "--config" in rest:
        config = rest[rest.index("--config") + 1]
    print(show(role, rest, config))
    return 0


def main(argv: list[str] | None = None) -> int:
    from edgeps.settings import apply

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in LAYERED:  # the role's file and environment go under its flags
        try:
            apply(_roles(parser)[args.command], argv[argv.index(args.command) + 1 :], args.config)
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    started = time.monotonic()
    try:
        return args.func(args)
    except (ValueError, ConnectionError, FileNotFoundError, RuntimeError) as exc:  # CodecError, CheckpointError too
        logging.getLogger("edgeps").error("%s (after %.1f s)", exc, time.monotonic() - started)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``edgeps bench``'s subcommands and their options; each runs its ``cmd_bench_*`` (edgeps/cli/bench.py)."""

from __future__ import annotations

from edgeps.cli.bench import (
    cmd_bench_attack,
    cmd_bench_codec,
    cmd_bench_embedded,
    cmd_bench_footprint,
    cmd_bench_freq,
    cmd_bench_latency,
    cmd_bench_load,
    cmd_bench_pace,
    cmd_bench_restart,
    cmd_bench_scale,
    cmd_bench_shards,
    cmd_bench_sites,
    cmd_bench_tasks,
    cmd_bench_wire,
)
from edgeps.cli.common import Subparsers


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options and its function."""
    bench = sub.add_parser("bench", help="measurements").add_subparsers(dest="bench", required=True)
    for group in (_pace, _simulated, _load_and_attack, _real_jobs):
        group(bench)


def _pace(bench: Subparsers) -> None:
    """The pace comparison, simulated or over Mosquitto."""
    pace = bench.add_parser("pace", help="compare paces on one scenario (simulated, or --real over Mosquitto)")
    pace.add_argument("--real", action="store_true", help="real processes over a Mosquitto it starts (wall time)")
    pace.add_argument("--paces", help="comma-separated, default bsp,acbsp,asp,ssp:2 (real: bsp,acbsp)")
    pace.add_argument("--devices", type=int, help="default 16 (real: 8)")
    pace.add_argument("--slow-fraction", type=float, help="share of slow devices, default 0.25")
    pace.add_argument("--slowdown", type=float, help="slow devices' compute factor, default 4")
    pace.add_argument("--alpha", type=float, help="Dirichlet non-IID concentration, default 0.5")
    pace.add_argument("--target", type=float, help="target accuracy, default 0.90")
    pace.add_argument("--duration", type=float, help="seconds per run (virtual; real: wall), default 30 (real: 12)")
    pace.add_argument("--push-every", type=int, help="local steps per commit, default 10")
    pace.add_argument("--lr", type=float, help="the devices' learning rate, default 0.2")
    pace.add_argument("--seed", type=int, help="seed of data, model and devices, default 0")
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
    pace.add_argument(
        "--links",
        action="store_true",
        help="real runs: give each device the scenario's link (2 Mbit/s "
        "each way, 20 ms) through a shaping relay, as the simulator models it, instead of loopback's",
    )
    pace.set_defaults(func=cmd_bench_pace)


def _simulated(bench: Subparsers) -> None:
    """The benches on the simulator or in one process: frequency policies, sites, shards, scale, codecs."""
    freq = bench.add_parser("freq", help="push_every policies fixed, adacomm and trend on the pace scenario (acbsp)")
    freq.add_argument("--seed", type=int, help="seed of data, model and devices, default 0")
    freq.add_argument("--duration", type=float, help="virtual seconds per run, default 30")
    freq.add_argument("--target", type=float, help="target accuracy, default 0.90")
    freq.add_argument("--push-every", type=int, help="fixed's push_every, default 10")
    freq.add_argument("--push-every-min", type=int, help="adacomm/trend lower bound, default 1")
    freq.add_argument("--push-every-max", type=int, help="adacomm/trend upper bound, default 160")
    freq.add_argument("--json", help="write the report as JSON here")
    freq.add_argument("--plot", default="bench-freq.png", help="PNG of accuracy and push_every against time")
    freq.set_defaults(func=cmd_bench_freq)

    sites = bench.add_parser("sites", help="the same bsp job flat and over site aggregators, in the simulator")
    sites.add_argument("--devices", type=int, default=1000, help="devices in the job")
    sites.add_argument("--sites", type=int, default=10, help="sites they are spread over, an aggregator each")
    sites.add_argument("--rounds", type=int, default=3, help="versions in each job")
    sites.add_argument("--json", help="write the report as JSON here")
    sites.set_defaults(func=cmd_bench_sites)

    shards = bench.add_parser("shards", help="parameter sharding by key range, simulated with the real server core")
    shards.add_argument("--shards", default="1,2,4", help="comma-separated shard counts (1: one server)")
    shards.add_argument("--devices", type=int, default=16, help="devices committing each round")
    shards.add_argument("--rounds", type=int, default=5, help="bsp rounds at each shard count")
    shards.add_argument("--json", help="write the report as JSON here")
    shards.set_defaults(func=cmd_bench_shards)

    scale = bench.add_parser("scale", help="cost curves against the fleet and the model size (simulated), log-log")
    scale.add_argument("--fleets", default="16,64,256,1024", help="fleet sizes to run, comma-separated")
    scale.add_argument("--rounds", type=int, default=3, help="bsp versions in each job")
    scale.add_argument("--out", default="edgeps-scale", help="folder for the plots")
    scale.add_argument("--json", help="write the report as JSON here")
    scale.set_defaults(func=cmd_bench_scale)

    codec = bench.add_parser("codec", help="compression ratio, error and speed of every codec against numpy's copy")
    codec.add_argument(
        "--codecs",
        default="fp32,fp16,int8,sign,ternary,qsgd:16,topk:0.01",
        help="comma-separated codec specs to measure",
    )
    codec.add_argument("--sizes", default="1M,4M", help="tensor sizes in float32 values (M = 2**20)")
    codec.add_argument("--repeats", type=int, default=9, help="timings per measurement; the fastest counts")
    codec.add_argument("--json", help="write the report as JSON here")
    codec.set_defaults(func=cmd_bench_codec)


def _load_and_attack(bench: Subparsers) -> None:
    """The server under load over Mosquitto, and the hostile-client audit."""
    load = bench.add_parser("load", help="N device clients over one Mosquitto against a real server, for S seconds")
    load.add_argument("--devices", type=int, default=200, help="simulated devices committing")
    load.add_argument("--seconds", type=float, help="how long to offer the load (default: 60, or 8 with --capacity)")
    load.add_argument("--rate", type=float, default=1.0, help="commits per second per device")
    load.add_argument("--flood", action="store_true", help="one device sends 250 commits/s (rate limiting)")
    load.add_argument(
        "--capacity",
        action="store_true",
        help="the broker's raw rate for the commit payload and the server's apply rate, and their ratio",
    )
    load.add_argument("--checkpoint", action="store_true", help="with --capacity: the apply rate with --checkpoint too")
    load.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="with --checkpoint: phases with it and as many without, in the order ABBA (default: 2)",
    )
    load.add_argument("--profile", help="with --capacity: run the server under cProfile, its statistics to this file")
    load.add_argument(
        "--workers",
        type=int,
        action="append",
        metavar="K",
        help="with --capacity: the apply rate of a server behind K ingest workers too, in the same "
        "run (repeatable; docs/SCALING.md)",
    )
    load.add_argument("--json", help="write the report as JSON here")
    load.set_defaults(func=cmd_bench_load)

    from edgeps.bench.attack.audit import ATTACKS, PATHS

    attack = bench.add_parser(
        "attack",
        help="the hostile-client audit against real deployments (broker init: TLS, "
        "ACLs): flat, bridged sites with an aggregator, ingest workers",
    )
    attack.add_argument("--paths", default=",".join(PATHS), help="comma-separated: flat, sites, workers")
    attack.add_argument(
        "--attacks",
        default=",".join(ATTACKS),
        help="comma-separated: " + "; ".join(f"{name}: {what}" for name, what in ATTACKS.items()),
    )
    attack.add_argument("--rounds", type=int, default=150, help="bsp versions in each job")
    attack.add_argument("--round-deadline", type=float, default=1.0, help="the jobs' round deadline, seconds")
    attack.add_argument("--json", help="write the report as JSON here (its list: attacks)")
    attack.add_argument(
        "--plot", default="bench-attack.png", help="PNG of each attack's accuracy against the clean job's"
    )
    attack.set_defaults(func=cmd_bench_attack)


def _real_jobs(bench: Subparsers) -> None:
    """Real jobs measured: a device install, restarts, the C SDK, latency, bytes on the wire, tasks."""
    footprint = bench.add_parser("footprint", help="a fresh device install: size on disk, client peak RSS per backend")
    footprint.add_argument("--rounds", type=int, default=20, help="versions in each client's job")
    footprint.add_argument("--json", help="write the report as JSON here")
    footprint.set_defaults(func=cmd_bench_footprint)

    restart = bench.add_parser("restart", help="a job whose server, then one of whose devices, restarts N times")
    restart.add_argument("--trials", type=int, default=10, help="restarts in each job")
    restart.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGKILL"], help="how the server stops")
    restart.add_argument("--round-deadline", type=float, default=10.0, help="the jobs' round deadline, seconds")
    restart.add_argument("--json", help="write the report as JSON here")
    restart.set_defaults(func=cmd_bench_restart)

    embedded = bench.add_parser("embedded", help="the C device SDK: flash/RAM, QEMU, jobs of C devices and firmware")
    embedded.add_argument("--rounds", type=int, default=100, help="versions in each real job")
    embedded.add_argument(
        "--firmware-rounds",
        type=int,
        default=40,
        help="versions in each job with firmware "
        "images (four QEMUs: some 5 s a version on 2 cores), compared with the all-Python job's "
        "first as many",
    )
    embedded.add_argument("--devices", type=int, default=8, help="device processes in each real job")
    embedded.add_argument("--json", help="write the report as JSON here")
    embedded.set_defaults(func=cmd_bench_embedded)

    latency = bench.add_parser("latency", help="where each version's wall time goes: devices' share, server's share")
    latency.add_argument("--rounds", type=int, default=100, help="versions the job makes")
    latency.add_argument("--devices", type=int, default=8, help="device processes")
    latency.add_argument("--pace", default="bsp", choices=["bsp", "acbsp", "ssp", "asp"], help="the job's pace")
    latency.add_argument("--json", help="write the report as JSON here")
    latency.set_defaults(func=cmd_bench_latency)

    wire = bench.add_parser("wire", help="bytes on the devices' links by topic and direction (a counting relay)")
    wire.add_argument("--codec", default="sign", help="the commits' codec")
    wire.add_argument("--pull-codec", default="ternary", help="the parameters' codec")
    wire.add_argument("--rounds", type=int, default=100, help="versions the job makes")
    wire.add_argument("--json", help="write the report as JSON here")
    wire.set_defaults(func=cmd_bench_wire)

    tasks = bench.add_parser("tasks", help="each task with the demo's defaults against a centralised model")
    tasks.add_argument("--task", action="append", help="a task file (repeatable; default: the examples/ ones)")
    tasks.add_argument("--codecs", default="fp32,sign", help="commit codecs, a demo each, comma-separated")
    tasks.add_argument("--out", default="edgeps-bench-tasks", help="folder for the demos' files")
    tasks.add_argument("--json", help="write the report as JSON here")
    tasks.set_defaults(func=cmd_bench_tasks)

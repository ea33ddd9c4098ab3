"""``edgeps bench ...``: the measurements (edgeps/bench/)."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ps_service.paces import make_pace


def cmd_bench_pace(args: argparse.Namespace) -> int:
    from edgeps.bench.common import real_scenario, replace_scenario
    from edgeps.bench.pace import DEFAULT_PACES, run_bench_pace
    from edgeps.scenario import Scenario
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
    if args.seeds > 1 and args.real:
        raise ValueError("--seeds runs in the simulator; drop --real")
    if args.links and not args.real:
        raise ValueError("--links shapes the devices' links of a real run; add --real")
    run_bench_pace(
        scenario,
        paces,
        args.real,
        args.json,
        Path(args.plot),
        out,
        codecs=args.codec,
        seeds=args.seeds,
        links=args.links,
    )
    return 0


def cmd_bench_freq(args: argparse.Namespace) -> int:
    from edgeps.bench.common import replace_scenario
    from edgeps.bench.freq import run_bench_freq
    from edgeps.scenario import Scenario

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
    format_footprint(report).print()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def cmd_bench_load(args: argparse.Namespace) -> int:
    from edgeps.bench.load import run_bench_load

    if not args.verbose:
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    if args.capacity:
        from edgeps.bench.capacity import bench_capacity, format_capacity

        seconds = 8.0 if args.seconds is None else args.seconds
        profile = Path(args.profile).resolve() if args.profile else None
        _shown(
            args,
            lambda: bench_capacity(
                min(args.devices, 100),
                seconds,
                checkpoint=args.checkpoint,
                profile=profile,
                workers=tuple(args.workers or ()),
                repeats=args.repeats,
            ),
            format_capacity,
        )
        if profile:
            print(f"the server's profile: {profile} (python -m pstats {profile})")
        return 0
    report = run_bench_load(
        args.devices, 60.0 if args.seconds is None else args.seconds, args.rate, args.flood, args.json
    )
    return 0 if report["balanced"] else 1


def cmd_bench_attack(args: argparse.Namespace) -> int:
    from edgeps.bench.attack.audit import run_bench_attack

    paths = tuple(p for p in args.paths.split(",") if p)
    attacks = tuple(a for a in args.attacks.split(",") if a)
    run_bench_attack(paths, attacks, args.rounds, args.round_deadline, args.json, args.plot)
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
    report = run_bench_embedded(args.rounds, args.devices, args.json, args.firmware_rounds)
    return 0 if report["qemu_ok"] else 1


def _shown(
    args: argparse.Namespace, run: Callable[[], dict[str, Any]], table: Callable[[dict[str, Any]], Any]
) -> dict[str, Any]:
    """A bench's run with edgeps' own logs at warnings (unless -v), then its table and, with --json, its report."""
    from edgeps.bench.common import show

    if not args.verbose:
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    report = run()
    return show(report, table(report), args.json)


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from edgeps.bench.latency import bench_latency, format_latency

    _shown(args, lambda: bench_latency(args.rounds, args.devices, args.pace), format_latency)
    return 0


def cmd_bench_wire(args: argparse.Namespace) -> int:
    from edgeps.bench.wire import bench_wire, format_wire

    _shown(args, lambda: bench_wire(args.codec, args.pull_codec, args.rounds), format_wire)
    return 0


def cmd_bench_scale(args: argparse.Namespace) -> int:
    from edgeps.bench.scale import bench_scale, format_scale

    fleets = tuple(int(n) for n in args.fleets.split(","))
    _shown(args, lambda: bench_scale(fleets, rounds=args.rounds, out=Path(args.out)), format_scale)
    print(f"plots: {Path(args.out) / 'scale-fleet.png'}, {Path(args.out) / 'scale-model.png'}")
    return 0


def cmd_bench_sites(args: argparse.Namespace) -> int:
    from edgeps.bench.sites import bench_sites, format_sites

    _shown(args, lambda: bench_sites(args.devices, args.sites, args.rounds), format_sites)
    return 0


def cmd_bench_shards(args: argparse.Namespace) -> int:
    from edgeps.bench.shards import bench_shards, format_shards

    shards = tuple(int(n) for n in args.shards.split(","))
    _shown(args, lambda: bench_shards(shards=shards, devices=args.devices, rounds=args.rounds), format_shards)
    return 0


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


def cmd_bench_tasks(args: argparse.Namespace) -> int:
    from edgeps.bench.tasks import DEFAULT_TASKS, EXAMPLES, bench_tasks, format_tasks
    from schemas.codecs import make_codec

    tasks = [Path(t) for t in args.task] if args.task else [EXAMPLES / name for name in DEFAULT_TASKS]
    for task in tasks:
        if not task.is_file():
            raise ValueError(f"--task {task}: no such task file")
    codecs = args.codecs.split(",")
    for codec in codecs:
        make_codec(codec)  # fail before training anything
    if not args.verbose:  # the table and the progress lines say it all
        logging.getLogger("edgeps").setLevel(logging.WARNING)
    report = bench_tasks(list(tasks), codecs, Path(args.out))
    format_tasks(report).print()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0

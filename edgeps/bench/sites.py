"""``edgeps bench sites``: what site aggregators save the core, in the simulator.

The same bsp job (the demo's model, ``--rounds`` versions, digits tiled so that every device holds
some 30 samples) over a flat fleet and over S sites, each with its aggregator (``ps_service/
aggregator.py``) and an uplink of ``site_up_bps`` to the core. The arithmetic is real: the devices'
training, the aggregators' sums, the server's aggregation. For each: virtual seconds per round,
bytes and messages reaching the server per round, the server core's CPU per round and the
aggregators' (process time spent in each core; the devices' statuses apart), and the accuracy of
the last version; the ratios of each, sites over flat, in the same run.
"""

from __future__ import annotations

import time
from typing import Any

from edgeps.bench.common import time_calls
from edgeps.bench.scale import _data
from edgeps.tables import Table


def measure(devices: int, sites: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """One bsp job of ``rounds`` versions over ``sites`` sites (0: every device on the core)."""
    from edgeps.scenario import Scenario
    from edgeps.simulator import Simulation, scenario_data

    job = {"rounds": rounds, "duration_s": 1e6, "round_deadline_s": 600.0}  # ServerConfig's, nested by the model
    scenario = Scenario.model_validate({"devices": devices, "sites": sites, "alpha": 100.0, "seed": seed, **job})
    sim = Simulation(scenario, "bsp", scenario_data(scenario, _data(devices, seed)))
    cpu = {"server": 0.0, "sites": 0.0}
    counts = {"messages": 0}

    def server_spent(args: tuple[Any, ...], seconds: float) -> None:
        if "/grad/" in args[0] or "/part/" in args[0]:  # commits and site commits; not statuses
            cpu["server"] += seconds
            counts["messages"] += 1

    def site_spent(args: tuple[Any, ...], seconds: float) -> None:
        cpu["sites"] += seconds

    time_calls(sim.server, "on_message", server_spent)
    for aggregator in sim.aggregators:
        for method in ("on_message", "flush"):
            time_calls(aggregator, method, site_spent)
    wall = time.perf_counter()
    result = sim.run()
    versions = max(1, sim.server.store.version)
    return {
        "devices": devices,
        "sites": sites,
        "versions": sim.server.store.version,
        "round_s": result.run_s / versions,
        "bytes_up_per_round": result.bytes_up / versions,
        "messages_per_round": counts["messages"] / versions,
        "server_cpu_per_round_s": cpu["server"] / versions,
        "sites_cpu_per_round_s": cpu["sites"] / versions,
        "accuracy": result.final_accuracy,
        "applied": sim.server.traffic.applied,
        "wall_s": round(time.perf_counter() - wall, 1),
    }


def bench_sites(devices: int = 1000, sites: int = 10, rounds: int = 3, say: Any = print) -> dict[str, Any]:
    """The flat job and the job over ``sites`` sites, and the ratios."""
    import logging

    logging.getLogger("edgeps").setLevel(logging.ERROR)
    rows = []
    for count in (0, sites):
        say(f"{devices} devices, {count or 'no'} sites, {rounds} bsp rounds ...", end=" ", flush=True)
        rows.append(measure(devices, count, rounds))
        say(f"{rows[-1]['wall_s']} s")
    flat, summed = rows
    keys = ("round_s", "bytes_up_per_round", "messages_per_round", "server_cpu_per_round_s")
    return {
        "devices": devices,
        "sites": sites,
        "rounds": rounds,
        "flat": flat,
        "with_sites": summed,
        "ratios": {k: round(summed[k] / flat[k], 4) if flat[k] else None for k in keys},
    }


def format_sites(report: dict[str, Any]) -> Table:
    flat, summed, ratios = report["flat"], report["with_sites"], report["ratios"]
    title = f"{report['devices']:,} devices, bsp, {report['rounds']} rounds, in the simulator"
    table = Table(["per round", "flat", f"{report['sites']} sites", "sites / flat"], before=[title])
    table.add("virtual time", f"{flat['round_s']:.2f} s", f"{summed['round_s']:.2f} s", f"{ratios['round_s']:.2f}")
    table.add(
        "bytes up into the core",
        f"{flat['bytes_up_per_round']:,.0f}",
        f"{summed['bytes_up_per_round']:,.0f}",
        f"{ratios['bytes_up_per_round']:.4f}",
    )
    table.add(
        "messages into the server",
        f"{flat['messages_per_round']:,.0f}",
        f"{summed['messages_per_round']:,.0f}",
        f"{ratios['messages_per_round']:.4f}",
    )
    table.add(
        "server CPU",
        f"{flat['server_cpu_per_round_s']:.3f} s",
        f"{summed['server_cpu_per_round_s']:.3f} s",
        f"{ratios['server_cpu_per_round_s']:.3f}",
    )
    table.add("aggregators' CPU (all sites)", "", f"{summed['sites_cpu_per_round_s']:.3f} s", "")
    table.add("accuracy of the last version", f"{flat['accuracy']:.4f}", f"{summed['accuracy']:.4f}", "")
    return table

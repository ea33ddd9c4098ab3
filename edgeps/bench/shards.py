"""``edgeps bench shards``: parameter sharding by key range (ps-lite's slicer), simulated with the
real server core.

The model's parameters, flattened tensor by tensor, are cut into S contiguous key ranges (every
tensor into S chunks); shard k is a ``ServerCore`` holding chunk k of every tensor. Each round,
each of N devices commits its update (the same random update at every S) to every shard as a
commit frame of that shard's chunks, and each shard aggregates its round and broadcasts its slice,
as a bsp server does. For each S: the CPU each shard's core spends a round (process time in the
core: validation, decoding, aggregation, the broadcast's encoding; the model's evaluation, which a
sharded job makes once on the gathered model, is left out at every S), and the bytes into each
shard and into all of them. Shards run side by side on their own cores, so a round's server time
is the busiest shard's; against one server (S = 1) in the same run.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from edgeps.tables import Table

MODELS = ((64,), (512, 512))
SHARDS = (1, 2, 4)


def _slices(params: dict[str, np.ndarray], shards: int) -> list[dict[str, np.ndarray]]:
    """Chunk k of every tensor, flattened, for k < ``shards``: the shards' key ranges."""
    out: list[dict[str, np.ndarray]] = [{} for _ in range(shards)]
    for name, values in params.items():
        for k, chunk in enumerate(np.array_split(values.ravel(), shards)):
            out[k][name] = np.ascontiguousarray(chunk, dtype=np.float32)
    return out


def measure(hidden: tuple[int, ...], shards: int, devices: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """One bsp job of ``rounds`` versions over ``shards`` shards; the shards' CPU and bytes a round."""
    from learning.data import Dataset
    from learning.model import init_mlp
    from ps_service.config import ServerConfig
    from ps_service.evaluator import Evaluator
    from ps_service.server.core import ServerCore
    from schemas.frame import Frame, FrameKind, encode_frame
    from schemas.messages import DeviceStatus

    params = init_mlp([64, *hidden, 10], seed)
    one_row = Dataset(np.zeros((1, 64), np.float32), np.zeros(1, np.int64))
    rng = np.random.default_rng(seed)
    updates = [
        {n: (rng.standard_normal(v.shape) * 1e-3).astype(np.float32) for n, v in params.items()} for _ in range(devices)
    ]
    names = [f"dev-{i:03d}" for i in range(devices)]
    cores = []
    for k, part in enumerate(_slices(params, shards)):
        config = ServerConfig(job=f"shard-{k}", pace="bsp", rounds=rounds, min_devices=devices)
        evaluator = Evaluator(one_row, predict=lambda p, x: np.zeros((len(x), 10), np.float32))  # left out
        core = ServerCore(config, part, evaluator, run=1)
        core.start(0.0)
        for name in names:
            status = DeviceStatus(device=name, state="online", incarnation=1, samples=100).to_bytes()
            core.on_message(core.topics.status(name), status, 0.0)
        cores.append(core)
    device_parts = [_slices(update, shards) for update in updates]
    cpu, received = [0.0] * shards, [0] * shards
    now = 1.0
    for version in range(rounds):
        for i, name in enumerate(names):
            for k, core in enumerate(cores):
                frame = Frame(
                    FrameKind.COMMIT, version, device_parts[i][k], device=name, seq=version + 1, samples=10, steps=1
                )
                payload = encode_frame(frame)
                received[k] += len(payload)
                started = time.process_time()
                core.on_message(core.topics.grad(name), payload, now)
                cpu[k] += time.process_time() - started
                now += 1e-4
    if any(core.store.version != rounds or core.traffic.applied != rounds * devices for core in cores):
        raise RuntimeError("a shard did not take every commit")
    return {
        "params": int(sum(v.size for v in params.values())),
        "shards": shards,
        "round_cpu_s": max(cpu) / rounds,  # the busiest shard: shards run side by side
        "total_cpu_s": sum(cpu) / rounds,
        "bytes_per_shard": max(received) / rounds,
        "bytes_total": sum(received) / rounds,
    }


def bench_shards(
    models: tuple[tuple[int, ...], ...] = MODELS,
    shards: tuple[int, ...] = SHARDS,
    devices: int = 16,
    rounds: int = 5,
    say: Any = print,
) -> dict[str, Any]:
    """Every model at every shard count, with each one's time against one server's."""
    rows = []
    for hidden in models:
        for count in shards:
            say(f"model (64, {', '.join(map(str, hidden))}, 10), {count} shard(s) ...", end=" ", flush=True)
            rows.append(measure(hidden, count, devices, rounds))
            say(f"{rows[-1]['round_cpu_s'] * 1e3:.1f} ms a round")
    for row in rows:
        one = next(r for r in rows if r["params"] == row["params"] and r["shards"] == 1)
        row["speedup"] = round(one["round_cpu_s"] / row["round_cpu_s"], 2)
        row["bytes_overhead"] = round(row["bytes_total"] / one["bytes_total"], 4)
    return {"devices": devices, "rounds": rounds, "rows": rows}


def format_shards(report: dict[str, Any]) -> Table:
    title = f"{report['devices']} devices, bsp, {report['rounds']} rounds; a round's server time = the busiest shard's"
    table = Table(
        [
            "parameters",
            "shards",
            "server CPU a round",
            "speedup",
            "bytes into a shard",
            "bytes into all",
            "all / one server",
        ],
        before=[title],
    )
    for r in report["rows"]:
        table.add(
            f"{r['params']:,}",
            str(r["shards"]),
            f"{r['round_cpu_s'] * 1e3:.1f} ms",
            f"{r['speedup']:.2f}x",
            f"{r['bytes_per_shard']:,.0f}",
            f"{r['bytes_total']:,.0f}",
            f"{r['bytes_overhead']:.4f}",
        )
    return table

"""``edgeps bench codec``: compression ratio, error and encode/decode speed of every codec."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from edgeps.bench.common import Say


def _best_times(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """The fastest of ``repeats`` runs of each function, in seconds, the functions taking turns
    so that a shared machine's slow spells hit them all alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            started = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - started)
    return best


def bench_codecs(
    specs: list[str], sizes: list[int], repeats: int = 5, seed: int = 0, say: Say = print
) -> dict[str, Any]:
    """Per codec and tensor size: compression ratio against fp32, relative error, and encode
    and decode throughput as a ratio to numpy's copy of the same array, timed in the same run."""
    import numpy as np

    from schemas.codecs import compiled, make_codec, relative_error

    loops = "compiled (schemas._kernels)" if compiled() else "numpy (schemas._kernels not built)"
    say(f"codec loops: {loops}")
    rows = []
    for n in sizes:
        values = np.random.default_rng(seed).normal(size=n).astype(np.float32)
        say(f"{n:,} float32 values:")
        for spec in specs:
            codec, rng = make_codec(spec), np.random.default_rng(seed)
            payload = codec.encode(values, rng)
            copy_s, encode_s, decode_s = _best_times(
                [values.copy, partial(codec.encode, values, rng), partial(codec.decode, payload, values.shape)], repeats
            )
            rows.append(
                {
                    "codec": codec.spec,
                    "values": n,
                    "ratio": round(4 * n / len(payload), 2),
                    "rel_error": round(relative_error(codec, values, np.random.default_rng(seed)), 5),
                    "encode_vs_copy": round(copy_s / encode_s, 3),
                    "decode_vs_copy": round(copy_s / decode_s, 3),
                }
            )
            r = rows[-1]
            say(
                f"  {r['codec']:<10} ratio {r['ratio']:>7.1f}  error {r['rel_error']:.4f}  "
                f"encode {r['encode_vs_copy']:.3f}x copy  decode {r['decode_vs_copy']:.3f}x copy  "
                f"(copy {4 * n / copy_s / 1e9:.1f} GB/s)"
            )
    return {"compiled": compiled(), "codecs": rows}

"""The embedded fallback broker (amqtt, MQTT 3.1.1), for machines without Mosquitto.

Run as ``python -m broker.fallback --port N``; ``edgeps broker`` does so when needed.
"""

from __future__ import annotations

import argparse
import asyncio


async def _serve(host: str, port: int) -> None:
    from amqtt.broker import Broker

    broker = Broker(
        {
            "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
    )
    await broker.start()
    try:
        await asyncio.Event().wait()
    finally:
        await broker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    args = parser.parse_args()
    asyncio.run(_serve(args.host, args.port))


if __name__ == "__main__":
    main()

"""The driver's turns when the role's checkpoint settles later (``before_publish`` returning a
``Settle``): a turn's results never leave, nor are its messages acknowledged, before its state is
durable; a turn with messages lets the next ``HELD`` turns be processed meanwhile; nothing is lost or doubled."""

from __future__ import annotations

import logging
import time

import pytest

from broker.driver import BATCH, HELD, Settle, drive
from broker.transport import Transport
from schemas.events import Events
from schemas.topics import Inbound, Publish


class Queue(Transport):
    """The broker as a list of messages waiting; what the driver does, written down in ``log``."""

    def __init__(self, count: int, log: list[tuple[str, int]], gap: int = 0) -> None:
        self.waiting = [Inbound(f"in/{mid}", b"", mid, 1) for mid in range(1, count + 1)]
        self.log, self.gap, self.taken = log, gap, 0  # gap: none more for a moment after every gap messages

    def publish(self, message: Publish) -> None:
        self.log.append(("publish", int(message.topic.split("/")[1])))

    def subscribe_only(self, topics: list[str]) -> None:
        pass

    def unsubscribe(self, topics: list[str]) -> None:
        pass

    def resubscribe(self, topics: list[str]) -> None:
        pass

    def receive(self, timeout: float) -> Inbound | None:
        if not self.waiting or (self.gap and self.taken == self.gap):
            self.taken = 0
            return None
        self.taken += 1
        return self.waiting.pop(0)

    def ack(self, message: Inbound) -> None:
        self.log.append(("ack", message.mid))

    def wait_acknowledged(self, timeout: float) -> bool:
        return True

    def close(self, last: Publish | None = None, end_session: bool = False) -> None:
        pass


class Echo:
    """A core that answers each message with one of its own, done after ``count`` of them."""

    def __init__(self, count: int, log: list[tuple[str, int]]) -> None:
        self.events, self.count, self.log, self.seen = Events(), count, log, 0

    @property
    def done(self) -> bool:
        return self.seen >= self.count

    def receive(self, message: Inbound, now: float) -> list[Publish]:
        self.seen += 1
        self.log.append(("receive", message.mid))
        return [Publish(f"out/{message.mid}", b"", qos=1)]

    def on_tick(self, now: float) -> list[Publish]:
        return []

    def after_batch(self, now: float) -> list[Publish]:
        return []

    def next_deadline(self) -> float | None:
        return None

    def subscriptions(self) -> list[str]:
        return []

    def resubscriptions(self) -> list[str]:
        return []

    def acknowledge(self, batch: list[Inbound]) -> list[Inbound]:
        return batch


class Sync:
    """A turn's state made durable only when the driver waits for it (a sync slower than any turn)."""

    def __init__(self, turn: int, log: list[tuple[str, int]], durable: bool = False) -> None:
        self.turn, self.log, self.durable = turn, log, durable
        if durable:
            log.append(("durable", turn))

    def done(self) -> bool:
        return self.durable

    def result(self) -> None:
        if not self.durable:
            self.durable = True
            self.log.append(("durable", self.turn))


@pytest.mark.parametrize(("count", "gap"), [(BATCH // 2, 0), (BATCH, 0), (11 * BATCH + 5, 0), (100, 10)])
def test_a_turn_whose_checkpoint_settles_later_publishes_and_acknowledges_after_it(count, gap) -> None:
    log: list[tuple[str, int]] = []
    turns: list[list[int]] = []

    def before_publish(batch: list[Inbound], out: list[Publish]) -> Settle:
        turns.append([m.mid for m in batch])
        return Sync(len(turns) - 1, log)

    drive(
        Echo(count, log), Queue(count, log, gap), time.monotonic, before_publish=before_publish, log=logging.getLogger()
    )
    where = {event: i for i, event in enumerate(log)}
    assert [mid for kind, mid in log if kind == "receive"] == list(range(1, count + 1))
    assert [mid for kind, mid in log if kind == "publish"] == list(range(1, count + 1))  # each once, in order
    assert sorted(mid for kind, mid in log if kind == "ack") == list(range(1, count + 1))
    for turn, mids in enumerate(turns):
        for mid in mids:  # nothing of a turn leaves before its state is durable
            assert where[("durable", turn)] < where[("publish", mid)] and where[("durable", turn)] < where[("ack", mid)]
        following = turns[turn + 1 : turn + 1 + HELD]
        if mids and len(following) == HELD and all(following):
            # the next HELD turns' messages were processed while its sync ran, and only theirs
            assert all(where[("receive", later[0])] < where[("durable", turn)] for later in following)
            assert all(
                where[("durable", turn)] < where[("receive", mid)]
                for later in turns[turn + 1 + HELD :]
                for mid in later
            )
    if gap:  # a turn of fewer than a batch is held too (it never waits for more)
        assert any(0 < len(mids) < BATCH for mids in turns)


def test_a_turn_settled_before_the_next_one_finishes_at_once() -> None:
    """A held turn whose state is already durable is not kept waiting for ``HELD`` more turns: its
    results leave, and its messages are acknowledged, before the next turn's messages are taken."""
    log: list[tuple[str, int]] = []
    turns: list[list[int]] = []

    def before_publish(batch: list[Inbound], out: list[Publish]) -> Settle:
        turns.append([m.mid for m in batch])
        return Sync(len(turns) - 1, log, durable=True)  # a sync faster than the turn

    count = 4 * BATCH
    drive(Echo(count, log), Queue(count, log), time.monotonic, before_publish=before_publish, log=logging.getLogger())
    where = {event: i for i, event in enumerate(log)}
    for turn, mids in enumerate(turns[:-1]):
        if mids and turns[turn + 1]:
            first_of_next = where[("receive", turns[turn + 1][0])]
            assert all(where[("publish", mid)] < first_of_next and where[("ack", mid)] < first_of_next for mid in mids)

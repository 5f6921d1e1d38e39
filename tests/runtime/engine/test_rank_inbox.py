"""The engine's inbox: every answer reaches the handler of its type, read through the one
fan-in and decoded by the channel it came on, so a message its channel does not carry is a
protocol error there, not an answer."""
import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.channel import Receiver
from kvrt.ipc.fanin import FanIn
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Producer
from kvrt.runtime.engine.rank_inbox import RankInbox


class _Counts:
    def __init__(self):
        self.counted: list[str] = []

    def count(self, name: str, n: int = 1) -> None:
        self.counted.append(name)


class _NoConnector:
    def on_rank_message(self, msg: object) -> bool:
        return False


def test_each_answer_goes_to_its_handler_and_a_stray_type_is_a_protocol_error(node):
    channels = (P.worker_answers(0), P.transfer_answers(0))
    with Registry.create(node) as reg:
        reg.create_doorbell(P.ENGINE_BELL)
        for ch in channels:
            ch.create(reg, 4096, bell=P.ENGINE_BELL)
        raw = [Producer.attach(reg, ch.obj) for ch in channels]  # ranks that bypass their channels
        inbound = [Receiver.attach(reg, ch) for ch in channels]
        got: list[object] = []
        stats = _Counts()
        inbox = RankInbox(FanIn([r.ring for r in inbound]), inbound,
                          {P.StepResult: got.append, P.TransferDone: got.append}, _NoConnector(), stats)
        step = P.StepResult(7, 0, np.array([3], np.int32))
        raw[1].put(P.PROTOCOL.encode(step), 1.0)  # a step answer on the cache-transfer ring
        raw[0].put(P.PROTOCOL.encode(step), 1.0)
        raw[1].put(P.PROTOCOL.encode(P.TransferDone(4, 0, True, 1)), 1.0)
        inbox.dispatch(inbox.wait(1.0))
        assert [type(m) for m in got] == [P.StepResult, P.TransferDone] and got[0].step_id == 7
        assert stats.counted == ["protocol_errors"] and inbound[1].ring.stats()["protocol_errors"] == 1
        for end in raw + inbound:
            end.detach()

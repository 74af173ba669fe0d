"""The relay's async driver over an engine call's real event channel: what reaches the
client and what the output counted stay one, however a move interleaves with a wait."""

from __future__ import annotations

import trio
import trio.testing

from direct_frontend.engines.neutral import TokenDelta
from direct_frontend.engines.transport import EventReceiver, StreamItem
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.observability.metrics import Metrics
from direct_frontend.pipeline.attempt import Phase
from direct_frontend.pipeline.leg import EngineCall
from direct_frontend.pipeline.relay import Relay
from direct_frontend.pipeline.relay_events import Batch, RelayEvent
from direct_frontend.routing.hitrate import HitRateWatch
from direct_frontend.text.model_dir import TextModel
from tests.pipeline.test_relay import relay_state, two_engines, word_ids


async def test_an_event_handed_over_as_a_move_cuts_the_wait_is_left_for_the_next_engine(
    text_model: TextModel, mock_clock: trio.testing.MockClock,
) -> None:
    """The engine's tokens reach the waiting relay (it is scheduled with them) and, before
    it runs, a drain moves it off: the tokens are not taken, so none is counted that the
    client never got, and the continuation starts from what the client has."""
    state, dispatcher = relay_state(text_model, two_engines(), max_tokens=12)
    metrics = Metrics()
    relay = Relay(dispatcher, text_model, metrics, HitRateWatch(metrics))
    engine_send, engine_receive = trio.open_memory_channel[StreamItem](8)
    engine_call = EngineCall(state.attempt.placement.engine, state.attempt.call,
                             EventReceiver(engine_receive))
    client_send, client_receive = trio.open_memory_channel[RelayEvent](8)
    ended: list[EngineError] = []
    stalls: list[trio.CancelScope] = []

    async def relaying() -> None:
        with trio.CancelScope() as stall:
            stalls.append(stall)
            try:
                await relay._relay(state, engine_call, stall, client_send.send)
            except EngineError as error:
                ended.append(error)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(relaying)
        await trio.testing.wait_all_tasks_blocked()
        assert state.attempt.phase is Phase.WAITING
        engine_send.send_nowait([TokenDelta(word_ids(text_model, "hello there"))])
        state.attempt.leave(stalls[0].cancel)  # in the same step: the relay has not run
    client_send.close()
    handed_on = [event async for event in client_receive]
    streamed = "".join(event.text for event in handed_on if isinstance(event, Batch))
    counted = text_model.decode(list(state.output.processor.generated_ids))
    assert streamed == counted
    assert [error.kind for error in ended] == [ErrorKind.DRAINING]

"""A streamed answer's status line and headers go out with its first event (completions.event_stream)."""

import asyncio

import pytest

from graphserving.runtime.api.completions import event_stream
from graphserving.runtime.api.protocol import APIError


async def _connected():
    await asyncio.Event().wait()  # the client stays: receive never returns
    return {"type": "http.disconnect"}


async def _disconnected():
    return {"type": "http.disconnect"}


async def test_the_response_exists_only_once_the_first_event_is_ready():
    gate, closed = asyncio.Event(), []

    async def events():
        try:
            await gate.wait()
            yield "data: 1\n\n"
            yield "data: [DONE]\n\n"
        finally:
            closed.append(True)

    pending = asyncio.ensure_future(event_stream(events(), _connected))
    await asyncio.sleep(0.05)
    assert not pending.done()  # no headers before the first event
    gate.set()
    response = await pending
    assert response.media_type == "text/event-stream"
    assert [chunk async for chunk in response.body_iterator] == ["data: 1\n\n", "data: [DONE]\n\n"]
    assert closed == [True]


async def test_a_client_gone_before_the_first_event_gets_499_and_its_stream_is_closed():
    closed = []

    async def events():
        try:
            await asyncio.Event().wait()
            yield "never"
        finally:
            closed.append(True)  # where the real generator aborts its engine requests

    response = await event_stream(events(), _disconnected)
    assert response.status_code == 499
    assert closed == [True]


async def test_an_error_before_the_first_event_is_the_routes_error_status():
    async def events():
        raise APIError(503, "no room", code="overloaded")
        yield  # pragma: no cover

    with pytest.raises(APIError) as err:
        await event_stream(events(), _connected)
    assert err.value.status == 503

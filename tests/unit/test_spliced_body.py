"""A big body forwarded from its spill file: the server reads the client's members with the
proxy's appended over them, the file is never read into memory, and closing gives it back."""

from __future__ import annotations

import gc
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from cacheproxy.http.body_worker import parse_file_and_check
from cacheproxy.slots.prompt_bounds import PromptLimits
from cacheproxy.slots.read_fields import LEFT_IN_FILE_BYTES
from cacheproxy.upstreams.relay import send_upstream
from cacheproxy.upstreams.spliced_body import FileBody, SpilledJson

PADDING = "p" * LEFT_IN_FILE_BYTES


def spilled(tmp_path: Path, body: bytes, on_close=lambda: None) -> SpilledJson:  # noqa: ANN001
    path = tmp_path / "body"
    path.write_bytes(body)
    parsed = parse_file_and_check(str(path), "/completion", PromptLimits())
    file = path.open("rb", buffering=0)
    return SpilledJson(
        file, len(body), parsed.object_end, parsed.document, parsed.left_in_file, on_close
    )


async def sent(body: FileBody) -> bytes:
    return b"".join([piece async for piece in body.pieces()])


async def test_what_the_proxy_changes_is_read_over_the_clients_members(tmp_path: Path) -> None:
    client = {"prompt": [1, 2], "id_slot": 7, "cache_prompt": True, "padding": PADDING}
    raw = orjson.dumps(client) + b" \n"
    body = spilled(tmp_path, raw)
    assert "padding" not in body.parsed and body.left_in_file == {"padding"}
    pinned = {**body.parsed, "id_slot": 2, "cache_prompt": False, "return_tokens": True}
    forwarded = await sent(body.with_document(pinned))
    # the client's bytes as they are, then the changes: read last, as llama-server reads them
    assert forwarded.startswith(raw.rstrip()[:-1])
    assert forwarded.endswith(b',"id_slot":2,"cache_prompt":false,"return_tokens":true}')
    assert orjson.loads(forwarded) == {**client, **pinned}
    body.close()


async def test_a_member_put_into_the_request_s_own_document_is_a_change(tmp_path: Path) -> None:
    path = tmp_path / "body"
    path.write_bytes(orjson.dumps({"prompt": [1], "padding": PADDING}))
    parsed = parse_file_and_check(str(path), "/completion", PromptLimits())
    with path.open("rb", buffering=0) as file:
        body = SpilledJson(
            file, path.stat().st_size, parsed.object_end, parsed.document, frozenset()
        )
        parsed.document["id_slot"] = 3  # the request's document, edited in place
        assert orjson.loads(await sent(body.with_document(parsed.document)))["id_slot"] == 3


async def test_an_unchanged_document_is_the_clients_body(tmp_path: Path) -> None:
    raw = orjson.dumps({"prompt": [1], "padding": PADDING})
    body = spilled(tmp_path, raw)
    assert body.with_document(dict(body.parsed)) is body
    assert await sent(body) == raw
    body.close()


async def test_a_dropped_count_is_null_and_no_other_member_can_be_dropped(tmp_path: Path) -> None:
    body = spilled(tmp_path, orjson.dumps({"prompt": [1], "n": 4, "seed": 1, "x": PADDING}))
    task = {key: value for key, value in body.parsed.items() if key != "n"}
    assert orjson.loads(await sent(body.with_document(task)))["n"] is None
    with pytest.raises(ValueError, match="seed"):
        body.with_document({"prompt": [1], "n": 4})
    body.close()


async def test_an_empty_object_gets_members_without_a_comma(tmp_path: Path) -> None:
    body = spilled(tmp_path, b"{ }")
    assert orjson.loads(await sent(body.with_document({"id_slot": 1}))) == {"id_slot": 1}
    body.close()


def test_closing_gives_back_once_and_so_does_collection(tmp_path: Path) -> None:
    closed: list[int] = []
    body = spilled(tmp_path, b"{}", lambda: closed.append(1))
    file = body.file
    body.close()
    body.close()
    assert closed == [1] and file.closed
    spilled(tmp_path, b"{}", lambda: closed.append(2))  # dropped at once
    gc.collect()
    assert closed == [1, 2]


async def test_aiohttps_client_sends_it_with_its_length(tmp_path: Path) -> None:
    received: list[tuple[str | None, bytes]] = []

    async def handler(request: web.Request) -> web.Response:
        received.append((request.headers.get("Content-Length"), await request.read()))
        return web.Response(text="ok")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/completion", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = URL(f"http://127.0.0.1:{runner.addresses[0][1]}/completion")
    raw = orjson.dumps({"prompt": [1], "padding": PADDING * 40})  # 2.6 MB
    body = spilled(tmp_path, raw)
    forwarded = body.with_document({**body.parsed, "id_slot": 0})
    try:
        async with aiohttp.ClientSession() as session:
            response = await send_upstream(session, "POST", url, forwarded, CIMultiDict())
            async with response:
                assert response.status == 200
    finally:
        await runner.cleanup()
        body.close()
    assert received == [(str(len(forwarded)), raw[:-1] + b',"id_slot":0}')]

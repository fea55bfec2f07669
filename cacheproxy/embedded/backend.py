"""What the proxy needs from an inference server, over a llama-server or the embedded engine.

Both speak llama-server's native JSON: `complete` returns the `/completion` answer
(`id_slot`, `tokens_cached`, `timings{cache_n, prompt_n, ...}`), `stream` yields its SSE
events, and the slot calls return `/slots/{id}?action=...` answers. `LlamaServerBackend` is a
thin HTTP client; `EmbeddedBackend` calls the in-process engine directly. The proxy itself
reaches an embedded engine over HTTP too (`cacheproxy.embedded.server.EmbeddedServer`), so its
routes, router and disk tier need no second code path; this interface is for code that wants
either backend without a socket (benchmarks, tests, tools).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import aiohttp
import orjson

if TYPE_CHECKING:
    from cacheproxy.embedded.engine import EmbeddedEngine


class BackendError(RuntimeError):
    """An answer in llama-server's error envelope."""

    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(f"{status} {error_type}: {message}")
        self.status = status
        self.message = message
        self.error_type = error_type


@runtime_checkable
class Backend(Protocol):
    async def health(self) -> bool: ...

    async def props(self) -> dict[str, Any]: ...

    async def tokenize(
        self, content: str, add_special: bool = False, parse_special: bool = True
    ) -> list[int]: ...

    async def detokenize(self, tokens: list[int]) -> str: ...

    async def apply_template(self, chat_body: dict[str, Any]) -> str: ...

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """`/completion` without streaming: the final answer."""
        ...

    def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """`/completion` with streaming: partial events, then the final one (`stop: true`)."""
        ...

    async def slots(self) -> list[dict[str, Any]]: ...

    async def save_slot(self, slot_id: int, filename: str) -> dict[str, Any]: ...

    async def restore_slot(self, slot_id: int, filename: str) -> dict[str, Any]: ...

    async def erase_slot(self, slot_id: int) -> dict[str, Any]: ...


class LlamaServerBackend:
    """A llama-server (or anything serving its API, such as `EmbeddedServer`) over HTTP."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"}
        async with self.session.request(
            method, self.base_url + path, data=data, headers=headers
        ) as response:
            payload = orjson.loads(await response.read() or b"null")
            if response.status >= 400:
                error = (payload or {}).get("error", {}) if isinstance(payload, dict) else {}
                raise BackendError(
                    response.status, error.get("message", ""), error.get("type", "server_error")
                )
            return payload

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health")
        except (BackendError, aiohttp.ClientError):
            return False
        return True

    async def props(self) -> dict[str, Any]:
        return await self._call("GET", "/props")

    async def tokenize(
        self, content: str, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        body = {"content": content, "add_special": add_special, "parse_special": parse_special}
        return (await self._call("POST", "/tokenize", body))["tokens"]

    async def detokenize(self, tokens: list[int]) -> str:
        return (await self._call("POST", "/detokenize", {"tokens": tokens}))["content"]

    async def apply_template(self, chat_body: dict[str, Any]) -> str:
        return (await self._call("POST", "/apply-template", chat_body))["prompt"]

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", "/completion", {**body, "stream": False})

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        # llama-server may close the connection once a stream ends: never reuse it for a POST
        headers = {"Content-Type": "application/json", "Connection": "close"}
        async with self.session.post(
            self.base_url + "/completion",
            data=orjson.dumps({**body, "stream": True}),
            headers=headers,
        ) as response:
            if response.status >= 400:
                error = orjson.loads(await response.read()).get("error", {})
                raise BackendError(response.status, error.get("message", ""), error.get("type"))
            async for line in response.content:
                if line.startswith(b"data: "):
                    event = orjson.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                        raise BackendError(error["code"], error["message"], error["type"])
                    yield event

    async def slots(self) -> list[dict[str, Any]]:
        return await self._call("GET", "/slots")

    async def save_slot(self, slot_id: int, filename: str) -> dict[str, Any]:
        return await self._call("POST", f"/slots/{slot_id}?action=save", {"filename": filename})

    async def restore_slot(self, slot_id: int, filename: str) -> dict[str, Any]:
        body = {"filename": filename}
        return await self._call("POST", f"/slots/{slot_id}?action=restore", body)

    async def erase_slot(self, slot_id: int) -> dict[str, Any]:
        return await self._call("POST", f"/slots/{slot_id}?action=erase", {})


class EmbeddedBackend:
    """The embedded engine, called in-process; answers as its HTTP API would give them."""

    def __init__(self, engine: EmbeddedEngine, slot_save_path: Path, model_name: str) -> None:
        from cacheproxy.embedded.http_api import EngineBridge

        self.engine = engine
        self.slot_save_path = slot_save_path
        self.model_name = model_name
        self._bridge = EngineBridge(engine)

    async def health(self) -> bool:
        return True

    async def props(self) -> dict[str, Any]:
        return {
            "total_slots": self.engine.config.n_slots,
            "model_alias": self.model_name,
            "default_generation_settings": {"n_ctx": self.engine.n_ctx_slot},
        }

    async def tokenize(
        self, content: str, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        return self.engine.tokenize(content, add_special, parse_special)

    async def detokenize(self, tokens: list[int]) -> str:
        return self.engine.detokenize(tokens)

    async def apply_template(self, chat_body: dict[str, Any]) -> str:
        from cacheproxy.embedded.http_api import apply_chat_template

        return _translated(apply_chat_template, self.engine, chat_body)

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        final: dict[str, Any] = {}
        async for event in self._events(body, stream=False):
            final = event
        return final

    def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self._events(body, stream=True)

    async def _events(self, body: dict[str, Any], stream: bool) -> AsyncIterator[dict[str, Any]]:
        from cacheproxy.embedded.engine import EngineError
        from cacheproxy.embedded.http_api import (
            _Done,
            _requested_slot,
            native_final,
            prompt_tokens,
            sampling_params,
        )

        prompt = _translated(prompt_tokens, self.engine, body.get("prompt", ""))
        events = self._bridge.run(
            prompt, sampling_params(body), _requested_slot(body), body.get("cache_prompt", True)
        )
        n_predicted = 0
        try:
            async for event in events:
                if isinstance(event, _Done):
                    yield native_final(
                        event.result,
                        self.engine,
                        bool(body.get("return_tokens")),
                        self.model_name,
                        prompt,
                        stream=stream,
                    )
                    return
                n_predicted += 1
                if stream and event[1]:
                    yield {
                        "index": 0,
                        "content": event[1],
                        "tokens": [event[0]],
                        "stop": False,
                        "id_slot": -1,
                        "tokens_predicted": n_predicted,
                        "tokens_evaluated": len(prompt),
                    }
        except EngineError as error:
            raise BackendError(error.code, error.message, error.error_type) from error

    async def slots(self) -> list[dict[str, Any]]:
        return self.engine.slot_report()

    async def _slot_command(self, action: str, slot_id: int, filename: str) -> dict[str, Any]:
        from cacheproxy.embedded.engine import EngineError
        from cacheproxy.embedded.http_api import valid_filename

        if action != "erase" and not valid_filename(filename):
            raise BackendError(400, "Invalid filename", "invalid_request_error")
        path = self.slot_save_path / filename if filename else None
        try:
            return await self._bridge.slot_command(action, slot_id, path, filename)
        except EngineError as error:
            raise BackendError(error.code, error.message, error.error_type) from error

    async def save_slot(self, slot_id: int, filename: str) -> dict[str, Any]:
        return await self._slot_command("save", slot_id, filename)

    async def restore_slot(self, slot_id: int, filename: str) -> dict[str, Any]:
        return await self._slot_command("restore", slot_id, filename)

    async def erase_slot(self, slot_id: int) -> dict[str, Any]:
        return await self._slot_command("erase", slot_id, "")


def _translated(function: Any, *args: Any) -> Any:
    """Run a request helper of the engine's API, its refusals as `BackendError`."""
    from cacheproxy.embedded.engine import EngineError

    try:
        return function(*args)
    except EngineError as error:
        raise BackendError(error.code, error.message, error.error_type) from error

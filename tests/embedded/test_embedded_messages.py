"""/v1/messages through the proxy in front of the embedded engine, which serves only the chat
form: the proxy's translation gives it the Anthropic API, streams included."""

from __future__ import annotations

from pathlib import Path

import anthropic

from cacheproxy.embedded.server import EmbeddedServer
from cacheproxy.settings import EmbeddedSettings, load_settings
from tests.support.servers import serving


async def test_the_anthropic_sdk_against_the_embedded_engine(
    tiny_model: Path, tmp_path: Path
) -> None:
    settings = load_settings(state_dir=tmp_path / "state")
    engine_server = EmbeddedServer(
        EmbeddedSettings(parallel=2, ctx_size=4096, threads=1), tiny_model, tmp_path / "engine"
    )
    system = "You are terse. " + " ".join(f"word{n}" for n in range(120))
    async with serving(settings, managed=engine_server) as (url, _):
        sdk = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        message = await sdk.messages.create(
            model="any",
            max_tokens=6,
            system=system,
            messages=[{"role": "user", "content": "Hello."}],
            extra_body={"temperature": 0},
        )
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
        follow_up = [
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": message.content[0].text},
            {"role": "user", "content": "More."},
        ]
        async with sdk.messages.stream(
            model="any", max_tokens=6, system=system, messages=follow_up
        ) as stream:
            text = "".join([chunk async for chunk in stream.text_stream])
            streamed = await stream.get_final_message()
    assert streamed.content[0].text == text
    assert streamed.usage.output_tokens == 6
    assert streamed.usage.cache_read_input_tokens > 100  # the first turn's slot, reused

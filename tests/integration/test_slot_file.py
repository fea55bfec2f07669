"""Slot save file headers: files built in llama-server's format, broken at every offset, and one
written by a real llama-server."""

from __future__ import annotations

import os
import secrets
import struct
from pathlib import Path

import pytest

from cacheproxy.disk.slot_file import (
    SLOT_FILE_MAGIC,
    SlotFileError,
    encode_slot_file,
    parse_slot_file,
    read_slot_file,
)
from tests.support.servers import StartServer
from tests.support.slot_files import kv_state, post_json, random_tokens

CELL_META_BYTES = 12  # pos, n_seq_id = 1, one seq_id: what a single-sequence cell writes


def test_a_packed_text_slot_gives_its_tokens_and_where_the_state_starts() -> None:
    tokens = random_tokens(70)
    state = kv_state(n_stream=4, stream=2, cells=70)
    data = encode_slot_file(tokens, state)

    header = parse_slot_file(data)

    assert header.tokens.tolist() == tokens
    assert header.packed and header.media_positions == ()
    # text only: n = T + 4 words (marker, version, T, the tokens, M = 0)
    assert header.state_offset == 12 + 4 * (70 + 4)
    assert data[header.state_offset :] == state
    assert (header.n_stream, header.cells, header.file_size) == (4, 70, len(data))


def test_a_file_on_disk_reads_like_the_same_bytes_in_memory(tmp_path: Path) -> None:
    data = encode_slot_file(random_tokens(300, seed=1), kv_state(1, 0, 300, data_bytes=5000))
    path = tmp_path / "a.slot"
    path.write_bytes(data)
    assert read_slot_file(path) == parse_slot_file(data)


def test_a_legacy_plain_token_list_and_an_empty_slot() -> None:
    tokens = random_tokens(10)
    legacy = parse_slot_file(encode_slot_file(tokens, kv_state(1, 0, 10), legacy=True))
    assert legacy.tokens.tolist() == tokens and not legacy.packed
    assert legacy.state_offset == 12 + 4 * 10

    empty = parse_slot_file(encode_slot_file([], kv_state(2, 1, 0)))
    assert empty.tokens.tolist() == [] and empty.packed and empty.cells == 0
    no_words = parse_slot_file(encode_slot_file([], kv_state(1, 0, 0), legacy=True))
    assert no_words.tokens.tolist() == [] and not no_words.packed


def test_media_chunks_are_skipped_and_their_positions_reported() -> None:
    tokens = random_tokens(20)
    tokens[3:8] = [-1] * 5
    tokens[12:14] = [-1] * 2
    # odd chunk lengths: the chunks are not word-aligned, only the whole blob is padded
    data = encode_slot_file(tokens, kv_state(1, 0, 20), media_chunks=[(12, b"xyz"), (3, b"abcd")])
    header = parse_slot_file(data)
    assert header.tokens.tolist() == tokens
    assert header.media_positions == (3, 12)
    # marker, version, T, tokens, M, positions; two length-prefixed chunks; one byte of padding
    assert header.state_offset == 12 + 4 * (3 + 20 + 1 + 2) + (4 + 4) + (4 + 3) + 1


def test_every_truncation_is_refused_until_the_first_cells_fit() -> None:
    tokens = random_tokens(70, seed=2)
    data = encode_slot_file(tokens, kv_state(n_stream=3, stream=1, cells=70, data_bytes=40))
    state_offset = 12 + 4 * 74
    # what the header check needs: n_stream, two cell counts, then 8 bytes of metadata per cell
    shortest_valid = state_offset + 4 + 4 + 4 + 8 * 70
    for length in range(len(data) + 1):
        if length < shortest_valid:
            with pytest.raises(SlotFileError):
                parse_slot_file(data[:length])
        else:
            assert parse_slot_file(data[:length]).tokens.tolist() == tokens


def test_files_truncated_on_disk_are_refused(tmp_path: Path) -> None:
    data = encode_slot_file(random_tokens(100), kv_state(1, 0, 100))
    path = tmp_path / "a.slot"
    state_offset = 12 + 4 * 104
    for length in (0, 3, 11, 12, 15, 24, state_offset - 1, state_offset, state_offset + 7):
        path.write_bytes(data)
        os.truncate(path, length)
        with pytest.raises(SlotFileError):
            read_slot_file(path)


def words(*values: int) -> bytes:
    return b"".join(struct.pack("<i" if value < 0 else "<I", value) for value in values)


def file_with_words(blob: bytes, state: bytes | None = None) -> bytes:
    state = kv_state(1, 0, 0) if state is None else state
    return struct.pack("<III", SLOT_FILE_MAGIC, 4, len(blob) // 4) + blob + state


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (words(-1), "end before"),  # no version
        (words(-1, 2, 0, 0), "packed token version 2"),
        (words(-1, 1), "end before"),  # no token count
        (words(-1, 1, 5, 7, 8, 0), "5 tokens"),  # T larger than the blob
        (words(-1, 1, 1, 7), "end before"),  # no media count
        (words(-1, 1, 1, 7, 3, 0), "3 media positions"),
        (words(-1, 1, 2, 7, -1, 1, 5) + words(1) + b"x\0\0\0", "does not match"),  # past T
        (words(-1, 1, 2, 7, -1, 1, 0) + words(1) + b"x\0\0\0", "does not match"),  # not a -1
        # two positions, not ascending
        (words(-1, 1, 3, -1, -1, 5, 2, 1, 0) + (words(1) + b"x\0\0\0") * 2, "does not match"),
        (words(-1, 1, 1, -1, 1, 0, 0), "is empty"),
        (words(-1, 1, 1, -1, 1, 0, 9) + b"abc\0", "media chunk of 9 bytes"),
        (words(-1, 1, 1, 7, 0, 0), "trailing data"),
        (words(-1, 1, 2, 7, -1, 0), "negative token id outside"),
        (words(5, -3, 9), "legacy token list holds a negative"),
    ],
)
def test_a_packed_blob_that_contradicts_itself_is_refused(blob: bytes, message: str) -> None:
    with pytest.raises(SlotFileError, match=message):
        parse_slot_file(file_with_words(blob))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (struct.pack("<III", 0x67677372, 4, 0), "bad magic"),
        (struct.pack("<III", SLOT_FILE_MAGIC, 3, 0), "version 3"),
        (struct.pack("<III", SLOT_FILE_MAGIC, 4, 2) + words(1), "past the end"),
        (file_with_words(words(1), state=b""), "no n_stream"),
        (file_with_words(words(1), state=struct.pack("<I", 0)), "0 KV streams"),
        (file_with_words(words(1), state=struct.pack("<I", 257)), "257 KV streams"),
        (file_with_words(words(1), state=struct.pack("<II", 2, 0)), "stream 1's cell count"),
        (file_with_words(words(1), state=struct.pack("<III", 1, 2, 0)), "metadata of 2 KV cells"),
    ],
)
def test_a_bad_header_or_state_start_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(SlotFileError, match=message):
        parse_slot_file(data)


def test_a_file_saved_by_llama_server_holds_prompt_and_generated_tokens(
    start_server: StartServer,
) -> None:
    server = start_server(parallel=2, ctx_size=4096)
    prompt = random_tokens(150, seed=3)
    completion = post_json(
        server.url + "/completion",
        {
            "prompt": prompt,
            "n_predict": 9,
            "temperature": 0,
            "ignore_eos": True,
            "return_tokens": True,
            "id_slot": 1,
        },
    )
    file_name = f"a_{secrets.token_hex(16)}.slot"
    saved = post_json(server.url + "/slots/1?action=save", {"filename": file_name})

    header = read_slot_file(server.slot_save_path / file_name)

    expected = (prompt + completion["tokens"])[: completion["tokens_cached"]]
    assert header.tokens.tolist() == expected
    assert header.n_tokens == saved["n_saved"] == completion["tokens_cached"] == 150 + 9 - 1
    assert header.file_size == saved["n_written"]
    assert header.packed and header.state_offset == 12 + 4 * (header.n_tokens + 4)
    # -np 2 without -kvu: one stream per slot; a plain llama model keeps a cell per token
    assert (header.n_stream, header.cells) == (2, header.n_tokens)

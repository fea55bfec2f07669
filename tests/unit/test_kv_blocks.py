"""The KV frame of a slot file and its blocks, on states shaped like llama.cpp's: framed or
refused, cut into blocks and put together again byte for byte, for the whole state or any
prefix of it, and every damaged block refused."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from cacheproxy.disk.blocks import block_hashes, pack, token_array
from cacheproxy.disk.checked_blocks import CheckedBlocks
from cacheproxy.disk.kv_assembly import BlockCheck, RestoreBlocks, assemble
from cacheproxy.disk.kv_blocks import (
    BLOCK_HEADER,
    BlockDamaged,
    StoredBlock,
    block_cuts,
    cut_payload,
    read_payload,
    write_block,
)
from cacheproxy.disk.kv_frame import KvFrame, Unframed, frame_of
from cacheproxy.disk.slot_file import encode_slot_file
from tests.support.slot_files import (
    framed_state,
    kv_frame,
    kv_state,
    prefix_state,
    random_tokens,
)

FRAMES = {
    "plain": kv_frame(),
    "transposed": kv_frame(v_trans=True),
    "4-streams": kv_frame(n_stream=4, stream=2),
    "4-streams-transposed": kv_frame(v_trans=True, n_stream=4, stream=3),
    "fewer-v-layers": kv_frame(layers=4, v_layers=2),
}


def cut_into_blocks(
    directory: Path, frame: KvFrame, data: bytes, tokens: list[int]
) -> list[StoredBlock]:
    framed = frame_of(data)
    array = np.frombuffer(data, dtype=np.uint8)
    return [
        write_block(
            directory,
            cut.key,
            cut.n_cells,
            cut_payload(frame, framed.placement, array, cut.start, cut.end),
        )
        for cut in block_cuts(token_array(tokens))
    ]


@pytest.mark.parametrize("shape", list(FRAMES))
@pytest.mark.parametrize("cells", [64, 150, 257])
def test_blocks_put_together_give_the_file_back_byte_for_byte(
    tmp_path: Path, shape: str, cells: int
) -> None:
    frame = FRAMES[shape]
    tokens = random_tokens(cells, seed=cells)
    state = framed_state(frame, cells, seed=cells)
    data = encode_slot_file(tokens, state)
    framed = frame_of(data)
    assert framed.frame == frame and framed.n_cells == cells
    assert KvFrame.from_json(frame.to_json()) == frame
    blocks = cut_into_blocks(tmp_path, frame, data, tokens)
    assert [block.n_cells for block in blocks] == [64] * (cells // 64) + (
        [cells % 64] if cells % 64 else []
    )
    assert sum(block.bytes for block in blocks) < len(data)  # no token header kept per block

    whole = tmp_path / "whole.slot"
    assert assemble(tmp_path, frame, tokens, blocks, whole) == len(data)
    assert whole.read_bytes() == data

    # any prefix, within a block or at its end: the first cells of every layer, nothing else
    for prefix in sorted({1, 63, 64, 65, cells - 1} & set(range(1, cells))):
        target = tmp_path / f"prefix-{prefix}.slot"
        assemble(tmp_path, frame, tokens[:prefix], blocks, target)
        expected = encode_slot_file(tokens[:prefix], prefix_state(frame, state, cells, prefix))
        assert target.read_bytes() == expected, prefix


def states_out_of_shape() -> dict[str, bytes]:
    frame = kv_frame()
    tokens = random_tokens(80)
    state = bytearray(framed_state(frame, 80))
    meta_at = 8

    def with_meta(cell: int, pos: int, n_seq: int, seq: int) -> bytes:
        changed = bytearray(state)
        struct.pack_into("<iIi", changed, meta_at + 12 * cell, pos, n_seq, seq)
        return bytes(changed)

    swapped = bytearray(state)
    swapped[meta_at : meta_at + 12], swapped[meta_at + 12 : meta_at + 24] = (
        state[meta_at + 12 : meta_at + 24],
        state[meta_at : meta_at + 12],
    )
    return {
        # a unified cache's cells may lie out of order
        "cells out of order": encode_slot_file(tokens, bytes(swapped)),
        "a position missing": encode_slot_file(tokens, with_meta(5, 81, 1, 0)),
        "two sequences": encode_slot_file(tokens, with_meta(5, 5, 2, 0)),
        "another sequence": encode_slot_file(tokens, with_meta(7, 7, 1, 3)),
        "fewer cells than tokens": encode_slot_file([*tokens, 9], bytes(state)),
        "data after the cache": encode_slot_file(tokens, bytes(state) + b"\0\0\0\1"),
        "a stand-in state": encode_slot_file(tokens, kv_state(1, 0, 80, data_bytes=64)),
        "a legacy token list": encode_slot_file(tokens, bytes(state), legacy=True),
        "no cells": encode_slot_file([], framed_state(frame, 0)[:8]),
    }


@pytest.mark.parametrize("problem", list(states_out_of_shape()))
def test_a_state_of_another_shape_is_not_framed(problem: str) -> None:
    with pytest.raises(Unframed):
        frame_of(states_out_of_shape()[problem])


def test_a_transposed_v_layer_of_another_width_does_not_frame() -> None:
    frame = kv_frame(v_trans=True)
    tokens = random_tokens(70)
    data = bytearray(encode_slot_file(tokens, framed_state(frame, 70)))
    placement = frame_of(bytes(data)).placement
    # the first V layer claims one more row than its data hold: the file no longer adds up
    struct.pack_into("<I", data, placement.v_offsets[0] - 4, frame.v[0][2] + 1)
    with pytest.raises(Unframed):
        frame_of(bytes(data))


def test_keys_stand_for_every_token_before_the_block_end() -> None:
    tokens = random_tokens(200, seed=5)
    cuts = block_cuts(token_array(tokens))
    assert [(cut.start, cut.end) for cut in cuts] == [(0, 64), (64, 128), (128, 192), (192, 200)]
    # a whole block's key is the index's chained hash there
    assert [cut.key for cut in cuts[:3]] == block_hashes(pack(token_array(tokens)))
    # the same start, another tail or a longer text: the whole blocks' keys stay
    longer = block_cuts(token_array([*tokens, 1, 2, 3]))
    assert [cut.key for cut in longer[:3]] == [cut.key for cut in cuts[:3]]
    assert longer[3].key != cuts[3].key
    # a token changed anywhere before a block changes its key and every later one
    changed = list(tokens)
    changed[10] += 1
    assert all(a.key != b.key for a, b in zip(block_cuts(token_array(changed)), cuts, strict=True))


def test_a_damaged_block_is_refused_whatever_the_damage(tmp_path: Path) -> None:
    frame = kv_frame(v_trans=True)
    tokens = random_tokens(200, seed=9)
    data = encode_slot_file(tokens, framed_state(frame, 200, seed=9))
    blocks = cut_into_blocks(tmp_path, frame, data, tokens)
    first, second = blocks[0], blocks[1]
    assert read_payload(tmp_path, first, frame).nbytes == first.bytes - 32

    def refused(block: StoredBlock, match: str) -> None:
        with pytest.raises(BlockDamaged, match=match):
            read_payload(tmp_path, block, frame)
        target = tmp_path / "out.slot"
        with pytest.raises(BlockDamaged):
            assemble(tmp_path, frame, tokens, blocks, target)
        assert not target.exists()

    path = tmp_path / first.file_name
    original = path.read_bytes()
    flipped = bytearray(original)
    flipped[-1] ^= 1  # one bit of one cell's data
    path.write_bytes(bytes(flipped))
    refused(first, "checksum")
    path.write_bytes(original[:-1])
    refused(first, "bytes")
    path.write_bytes((tmp_path / second.file_name).read_bytes())  # another block's file
    refused(first, "header")
    path.unlink()
    refused(first, "missing")


def test_a_file_written_unchecked_is_refused_by_its_blocks_check(tmp_path: Path) -> None:
    """The file for the server is written without checksums; the check (on a thread of its
    own, while the server reads the file) finds the damage of any block the file uses."""
    frame = kv_frame()
    tokens = random_tokens(200, seed=11)
    data = encode_slot_file(tokens, framed_state(frame, 200, seed=11))
    blocks = cut_into_blocks(tmp_path, frame, data, tokens)
    path = tmp_path / blocks[1].file_name
    flipped = bytearray(path.read_bytes())
    flipped[-1] ^= (
        1  # a cell the prefix of 70 cells does not take: the block is damaged all the same
    )
    path.write_bytes(bytes(flipped))

    intact = RestoreBlocks.open(tmp_path, frame, blocks, 64)
    check = BlockCheck(intact)
    intact.write(tokens[:64], tmp_path / "first.slot")
    check.finish()  # the first block alone: intact

    used = RestoreBlocks.open(tmp_path, frame, blocks, 70)
    check = BlockCheck(used)
    target = tmp_path / "prefix.slot"
    assert used.write(tokens[:70], target) == target.stat().st_size
    with pytest.raises(BlockDamaged, match="checksum"):
        check.finish()
    with pytest.raises(BlockDamaged, match="checksum"):
        assemble(tmp_path, frame, tokens[:70], blocks, target.with_suffix(".checked"))
    assert not target.with_suffix(".checked").exists()


def test_a_block_unchanged_since_it_matched_is_not_read_again_and_a_changed_one_is(
    tmp_path: Path,
) -> None:
    frame = kv_frame()
    tokens = random_tokens(200, seed=12)
    blocks = cut_into_blocks(
        tmp_path, frame, encode_slot_file(tokens, framed_state(frame, 200, seed=12)), tokens
    )
    payload = sum(block.bytes - BLOCK_HEADER.size for block in blocks[:3])  # 150 cells

    def check(checked: CheckedBlocks) -> int:
        with RestoreBlocks.open(tmp_path, frame, blocks, 150, checked) as used:
            return used.check()

    # files changed within the settle time (an hour here: the files were all written just now,
    # however slow the machine) are read at every check: a write in the same tick of the file
    # system's clock would not move their change time
    fresh = CheckedBlocks(settle_ns=3600 * 10**9)
    assert check(fresh) == payload and check(fresh) == payload
    # older ones (a settle of 0 here) are read once: their modification times set in the past,
    # so that the write below moves them whatever the tick
    for block in blocks:
        os.utime(tmp_path / block.file_name, ns=(1, 1))
    settled = CheckedBlocks(settle_ns=0)
    assert check(settled) == payload
    assert check(settled) == 0
    # a write to a block moves its file's times: read again, and refused
    with open(tmp_path / blocks[1].file_name, "r+b") as damaged:
        damaged.seek(BLOCK_HEADER.size + 5)
        byte = damaged.read(1)[0]
        damaged.seek(BLOCK_HEADER.size + 5)
        damaged.write(bytes([byte ^ 0x10]))
    with pytest.raises(BlockDamaged, match="checksum"):
        check(settled)
    # the blocks unchanged are still not read; the damaged one always is
    with RestoreBlocks.open(tmp_path, frame, blocks, 150, settled) as used:
        assert [block.stored for block in used.unchecked] == [blocks[1]]

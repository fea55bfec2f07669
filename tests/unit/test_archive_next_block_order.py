"""The range of an ordered index that holds exactly the strings starting with a prefix: from the
prefix up to `successor(prefix)`, whatever its last bytes."""

from __future__ import annotations

import itertools

from cacheproxy.disk.archive_reads import successor


def test_the_successor_bounds_exactly_the_strings_with_the_prefix() -> None:
    alphabet = [b"\x00", b"\x01", b"\xfe", b"\xff"]
    strings = [b"".join(parts) for n in range(4) for parts in itertools.product(alphabet, repeat=n)]
    for prefix in strings:
        above = successor(prefix)
        in_range = {s for s in strings if s >= prefix and (above is None or s < above)}
        assert in_range == {s for s in strings if s.startswith(prefix)}, prefix


def test_a_prefix_of_ff_bytes_has_no_upper_bound_and_a_carry_drops_them() -> None:
    assert successor(b"") is None
    assert successor(b"\xff\xff") is None
    assert successor(b"\x01\xff") == b"\x02"
    assert successor(b"\x01\x02") == b"\x01\x03"

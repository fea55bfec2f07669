"""The one form of a request path that the proxy authorizes, routes and forwards.

llama-server (cpp-httplib 0.59, vendor/cpp-httplib/httplib.cpp in the pinned tree) routes on a
path it decodes in its own way, and the proxy must never route one path while llama-server
serves another:

- `Server::parse_request_line` (httplib.cpp:8649-8706) cuts the target at `#` and `?`, then
  percent-decodes the whole path with `decode_path_component` (httplib.cpp:6683-6716): every
  `%XX`, `%2F` (a `/`) and `%00` included, and also the non-standard `%uXXXX`.
- It removes no dot segments and merges no slashes; a route matches the decoded path as a literal
  string (`PathParamsMatcher::match`, httplib.cpp:7648-7693). A path parameter runs to the next
  `/`, and a path that ends right after that `/` still matches, so `/slots/0/` is served as slot 0.
- llama-server decodes path parameters a second time (`get_params`, tools/server/server-http.cpp:
  575-610), so an encoded `%` (`%2530`) becomes a digit there.
- HEAD is served by the GET routes (httplib.cpp:9452), as aiohttp's `add_get` does.
- `--api-prefix` only prepends a fixed string to every route (server-http.cpp:114, 690): an
  upstream with a prefix is configured with it in its base URL, and the paths here stay the same.

Meanwhile the proxy's HTTP client (yarl) removes dot segments from the URL it sends. So the proxy
settles the path first, in one pure step: unreserved characters are decoded, dot segments removed
(RFC 3986 section 5.2.4), slashes merged and a trailing slash dropped, every other octet left
percent-encoded in upper case. What could be read two ways is refused instead: an encoded `/`, `\\`
or `%`, a control character, a `%` that is not `%XX`, a dot segment made of encoded dots, a `#`.
The proxy then routes on, and forwards, exactly the canonical path.
"""

from __future__ import annotations

import functools
import string

UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
# RFC 3986 pchar without "%": characters a path may carry as they are
PATH_LITERALS = UNRESERVED | frozenset("!$&'()*+,;=:@/")
HEX_DIGITS = frozenset(string.hexdigits)
# octets that must not appear in a path, encoded or not: each would let llama-server read a
# different path than the one authorized (a separator, an escape, a control character)
REFUSED_OCTETS = frozenset({0x2F, 0x5C, 0x25, 0x7F} | set(range(0x20)))
# Every request's path is made canonical, and clients use a handful of paths: the canonical
# forms of paths up to this long are remembered (a bounded number, so a bounded size).
MEMO_PATH_CHARS = 256
MEMO_PATHS = 1024


class UnsafePath(ValueError):
    """A path the proxy cannot put in one canonical form llama-server would read the same way."""


def canonical_target(target: str) -> str:
    """The request target (path and query, as received) with its path made canonical.

    The query is kept byte for byte: llama-server decodes it into parameters, not into the path.
    """
    if "#" in target:
        raise UnsafePath("a request target must not carry a fragment (#)")
    path, separator, query = target.partition("?")
    return canonical_path(path) + separator + query


def canonical_path(path: str) -> str:
    """`path` with unreserved characters decoded, dot segments removed, slashes merged, no
    trailing slash; `UnsafePath` for what could be read as another path."""
    if len(path) <= MEMO_PATH_CHARS:
        return _memoised_canonical_path(path)  # a refusal is raised again each time
    return _canonical_path(path)


@functools.lru_cache(maxsize=MEMO_PATHS)
def _memoised_canonical_path(path: str) -> str:
    return _canonical_path(path)


def _canonical_path(path: str) -> str:
    if not path.startswith("/"):
        raise UnsafePath("the path must start with /")
    segments: list[str] = []
    for raw_segment in path.split("/")[1:]:
        segment, had_escapes = _canonical_segment(raw_segment)
        if segment in (".", ".."):
            if had_escapes:
                raise UnsafePath("a dot segment must not be percent-encoded")
            if segment == ".." and segments:
                segments.pop()
        elif segment:  # an empty segment is a doubled or trailing slash
            segments.append(segment)
    return "/" + "/".join(segments)


def _canonical_segment(segment: str) -> tuple[str, bool]:
    """One segment in canonical form, and whether it held any percent-escape."""
    out: list[str] = []
    had_escapes = False
    index = 0
    while index < len(segment):
        char = segment[index]
        if char == "%":
            pair = segment[index + 1 : index + 3]
            if len(pair) != 2 or not set(pair) <= HEX_DIGITS:
                raise UnsafePath("a % in the path must start a %XX escape")
            out.append(_canonical_octet(int(pair, 16)))
            had_escapes = True
            index += 3
            continue
        if char in PATH_LITERALS:
            out.append(char)
        else:
            for octet in char.encode("utf-8", "surrogateescape"):
                out.append(_canonical_octet(octet))
        index += 1
    return "".join(out), had_escapes


def _canonical_octet(octet: int) -> str:
    if octet in REFUSED_OCTETS:
        raise UnsafePath(f"the path must not contain the octet 0x{octet:02X}")
    char = chr(octet)
    return char if char in UNRESERVED else f"%{octet:02X}"

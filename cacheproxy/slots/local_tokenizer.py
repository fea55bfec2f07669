"""Tokenizing in the proxy, with the upstream's own model file, where that is proven to give the
server's own ids: a `POST /tokenize` round trip waits behind whatever the server is doing, while
llama.cpp's tokenizer over a vocabulary loaded here does the server's own work without the wait.

Per upstream model (a router's instances each have theirs), once, in the background:
- `GET /props` names the model file (`model_path`); it must be readable here;
- its vocabulary is loaded alone (llama.cpp's `vocab_only`) on a worker thread, through
  llama-cpp-python (the `embedded` extra): without it, nothing is tokenized here;
- a battery of texts (special tokens, the chat template and its markers, BOS and EOS, unicode,
  runs of whitespace, digits, code, llama.cpp's own tokenizer test strings) is tokenized both
  here and by the server's `/tokenize`, with and without BOS and special-token parsing: only if
  every id agrees are that model's prompts tokenized here.
Until then, and for good after a refusal, the server tokenizes. Every answer's prompt count is
still checked against the mirror's (`TokenMirror.answered`): one that disagrees on a model
tokenized here sends that model back to the server (`distrust`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Protocol

from cacheproxy.errors import ApiError
from cacheproxy.ops.supervise import start_keyed
from cacheproxy.upstreams.pool import Upstream

log = logging.getLogger(__name__)

# A text longer than this is tokenized on a thread of the tokenizers' own (llama.cpp's tokenizer
# lets go of the GIL, so the loop serves on meanwhile). Its SentencePiece tokenizer takes about
# 0.6 us of CPU a character of English with the vocabulary in the CPU's caches, 2-3 us once other
# work has evicted it, as between requests under load (a chat turn's 125 new characters: 22 us
# in a loop of their own, 320 us in the proxy): 256 characters hold the loop for 150-650 us,
# less than a thread hop's wait under such load (an answer from a thread waited 1.4 ms for the
# loop, median, on the conversations benchmark); a longer text (a chat's whole prompt, where its
# template has no cut) is worth the hop.
INLINE_TEXT_CHARS = 256
TOKENIZING_THREADS = 2
# (add_special, parse_special): the prompts use (True, True), and (False, True) for the
# segments after the first; the others show a vocabulary's plain pieces and BOS apart
MODES = ((True, True), (False, True), (True, False), (False, False))
# the battery's round trips in flight at once: the server's HTTP threads answer /tokenize
# beside its decoding, and a proof is done within a few dozen requests
BATTERY_IN_FLIGHT = 8
Verdict = Literal["proven", "refused", "mispredicted"]

# Texts whose ids tell two tokenizers apart: special tokens of the common chat formats (a file
# that declares them splits them out, one that does not spells them), whitespace runs, digits
# (split one by one or in threes), code, unicode of several scripts and widths, and a share of
# llama.cpp's own tokenizer test strings (models/ggml-vocab-*.gguf.inp).
BATTERY: tuple[str, ...] = (
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\n\n\n",
    "\t\n",
    " \n \n",
    "Hello world",
    " Hello world",
    "Hello World!",
    "Hello, world!",
    " this is 🦙.cpp",
    "w048 7tuijk dsdfhu",
    "нещо на Български",
    "កាន់តែពិសេសអាចខលចេញ",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token)",
    "Hello\n Hello",
    " (",
    "\n =",
    "' era",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天\uff5e",
    "!!!!!!",
    "3",
    "33",
    "333",
    "3333",
    "33333",
    "333333",
    "3333333",
    "33333333",
    "333333333",
    "Cửa Việt",
    " discards",
    "3.14159 2,718 1e-9 0x7fff 12:30 2026-12-03",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # ids\n",
    "if (a && b || !c) { x += y >> 2; } else { return nullptr; }",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b\\n"}}',
    "<s>",
    "</s>",
    "<s> hello </s>",
    "<unk><pad><mask>",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<|user|>\nHi<|end|>\n<|assistant|>\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "[INST] Hi [/INST]",
    "<|system|>\n<|user|>\n<|assistant|>\n<|endoftext|>",
    "<think>\n</think>\n\n<tool_call>\n</tool_call>",
    "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "\u0000 nul \u00a0nbsp \u200b zwsp \u2028 \ufeff bom",
    "Äpfel ½ months ied 4 ½ months",
    "   Hello\n    Hello",
    "\u3000全角スペース　と、句読点。",
)


class Vocabulary(Protocol):
    """A model file's tokenizer, as llama-server's `common_tokenize` runs it."""

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_piece(self, token: int) -> bytes:
        """The text llama.cpp writes back for `token` (a special token as its text)."""
        ...


def load_vocabulary(path: Path) -> Vocabulary | None:
    """The vocabulary of the model file at `path` (blocking: on a worker thread), or None: the
    engine library is not installed, or it cannot read that file (a vocabulary type it does not
    know, a file that is no model)."""
    try:
        from cacheproxy.embedded.model import EngineError, VocabOnly
    except ImportError:
        return None
    try:
        return VocabOnly(path)
    except EngineError:
        return None


def battery_texts(props: dict) -> list[str]:
    """`BATTERY` and what the server says of its own model: its chat template (the markers it
    writes, in their context), its BOS and EOS texts, alone and around text."""
    texts = list(BATTERY)
    for name in ("chat_template", "bos_token", "eos_token"):
        text = props.get(name)
        if isinstance(text, str) and text:
            texts += [text, f"{text}Hello{text} world\n{text}"]
    return texts


def first_disagreement(
    texts: list[str], ours: list[list[int]], theirs: list[list[int]]
) -> str | None:
    """The first battery case whose ids differ, named (None: all agree)."""
    for index, (mine, servers) in enumerate(zip(ours, theirs, strict=True)):
        if mine != servers:
            text = texts[index // len(MODES)]
            add_special, parse_special = MODES[index % len(MODES)]
            return f"{text[:60]!r} (add_special={add_special}, parse_special={parse_special})"
    return None


ServerTokenize = Callable[[Upstream, str, bool, bool], Awaitable[list[int]]]
Props = Callable[[Upstream], Awaitable[dict]]
Load = Callable[[Path], Vocabulary | None]


class InProcessTokenizers:
    """The vocabulary each upstream model's prompts are tokenized with here, once proven.

    `verdicts` is called with the upstream's name and how it was judged ("proven", "refused",
    "mispredicted"), for the metrics.
    """

    def __init__(
        self,
        enabled: bool,
        props: Props,
        server_tokenize: ServerTokenize,
        verdicts: Callable[[str, Verdict], None] = lambda name, verdict: None,
        load: Load = load_vocabulary,
    ) -> None:
        self.enabled = enabled
        self._props = props
        self._server_tokenize = server_tokenize
        self._verdicts = verdicts
        self._load = load
        self._vocabularies: dict[str, Vocabulary | None] = {}  # None: the server tokenizes
        self._proving: dict[str, asyncio.Task[None]] = {}
        self._threads: ThreadPoolExecutor | None = None
        self._loaded: dict[tuple[str, int, int], Vocabulary] = {}  # by path, size and mtime

    def vocabulary(self, upstream: Upstream) -> Vocabulary | None:
        """The proven vocabulary of `upstream`'s model, or None (the server's `/tokenize`);
        the first call starts proving one in the background."""
        name = upstream.name
        vocabulary = self._vocabularies.get(name)
        if vocabulary is not None or not self.enabled or name in self._vocabularies:
            return vocabulary
        if name not in self._proving:
            start_keyed(self._proving, name, self._prove(upstream), f"tokenizer-proof {name}")
        return None

    def restarted(self, upstream: Upstream) -> None:
        """Another server process at `upstream`, maybe with another model: the verdict on the
        one before, or a proof of it under way, is dropped (the next `vocabulary` proves)."""
        self._vocabularies.pop(upstream.name, None)
        task = self._proving.pop(upstream.name, None)
        if task is not None:
            task.cancel()

    async def proven(self, upstream: Upstream) -> bool:
        """Whether `upstream`'s prompts are tokenized here, once a proof under way has ended."""
        self.vocabulary(upstream)
        task = self._proving.get(upstream.name)
        if task is not None:
            await asyncio.wait([task])
        return self._vocabularies.get(upstream.name) is not None

    def distrust(self, upstream: Upstream) -> bool:
        """The server counted another prompt length than the one made here: if `upstream`'s
        prompts were tokenized here, they no longer are (True), until its server restarts."""
        if self._vocabularies.get(upstream.name) is None:
            return False
        self._vocabularies[upstream.name] = None
        self._verdicts(upstream.name, "mispredicted")
        log.warning(
            "%s counted a prompt other than the proxy made it: its prompts are tokenized by "
            "the server (POST /tokenize) from now on",
            upstream.name,
        )
        return True

    async def tokenize(
        self, vocabulary: Vocabulary, text: str, add_special: bool, parse_special: bool
    ) -> list[int]:
        """`text`'s ids: inline when short, on a tokenizing thread when long enough to be felt
        (the threads start with the first long text)."""
        if len(text) <= INLINE_TEXT_CHARS:
            return vocabulary.tokenize(text, add_special, parse_special)
        if self._threads is None:
            self._threads = ThreadPoolExecutor(TOKENIZING_THREADS, thread_name_prefix="tokenize")
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, vocabulary.tokenize, text, add_special, parse_special
        )

    async def aclose(self) -> None:
        for task in self._proving.values():
            task.cancel()
        await asyncio.gather(*self._proving.values(), return_exceptions=True)
        self._proving.clear()
        if self._threads is not None:
            self._threads.shutdown(wait=False)

    async def _prove(self, upstream: Upstream) -> None:
        try:
            props = await self._props(upstream)
            refusal, vocabulary = await self._vocabulary_of(props)
            if vocabulary is not None:
                refusal = await self._battery(upstream, vocabulary, battery_texts(props))
        except Exception as exc:  # the server is unreachable for now: proven at a next request
            log.info("in-process tokenizer of %s not proven yet: %r", upstream.name, exc)
            return
        if refusal is None:
            self._vocabularies[upstream.name] = vocabulary
            self._verdicts(upstream.name, "proven")
            log.info("%s: prompts are tokenized in the proxy (the battery agreed)", upstream.name)
            return
        self._vocabularies[upstream.name] = None
        self._verdicts(upstream.name, "refused")
        log.log(
            logging.WARNING if vocabulary is not None else logging.INFO,
            "%s: prompts are tokenized by the server: %s",
            upstream.name,
            refusal,
        )

    async def _vocabulary_of(self, props: dict) -> tuple[str | None, Vocabulary | None]:
        """The vocabulary of the file the server names, or why there is none."""
        path = props.get("model_path")
        if not isinstance(path, str) or not path:
            return "it names no model file", None
        return await asyncio.to_thread(self._read_vocabulary, Path(path))

    def _read_vocabulary(self, path: Path) -> tuple[str | None, Vocabulary | None]:
        """(blocking: a file read) One load per file: upstreams serving the same file share
        it (each is still proven on its own)."""
        try:
            stat = path.stat()
        except OSError:
            stat = None
        if stat is None or not path.is_file() or not os.access(path, os.R_OK):
            return f"its model file {path} is not readable here", None
        identity = (str(path), stat.st_size, stat.st_mtime_ns)
        vocabulary = self._loaded.get(identity)
        if vocabulary is None:
            vocabulary = self._load(path)
        if vocabulary is None:
            return (
                f"the vocabulary of {path} does not load here (llama-cpp-python, the embedded"
                " extra, is missing, or its llama.cpp does not read this file)",
                None,
            )
        self._loaded[identity] = vocabulary
        return None, vocabulary

    async def _battery(
        self, upstream: Upstream, vocabulary: Vocabulary, texts: list[str]
    ) -> str | None:
        """Why the vocabulary is not the server's (None: every text agrees in every mode)."""
        cases = [(text, *mode) for text in texts for mode in MODES]
        ours = await asyncio.to_thread(lambda: [vocabulary.tokenize(*case) for case in cases])
        theirs: list[list[int]] = []
        for start in range(0, len(cases), BATTERY_IN_FLIGHT):
            batch = cases[start : start + BATTERY_IN_FLIGHT]
            try:
                theirs += await asyncio.gather(
                    *(self._server_tokenize(upstream, *case) for case in batch)
                )
            except ApiError as exc:
                if exc.status >= 500:
                    raise  # busy or restarting: proven at a next request
                return f"it refused a battery text ({exc})"  # its texts are its own to tokenize
        disagreement = first_disagreement(texts, ours, theirs)
        return None if disagreement is None else f"its ids differ on {disagreement}"

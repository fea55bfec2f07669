"""The model, loaded through llama-cpp-python's low-level API, and what is read from it: tokens
and their text, the chat template, its metadata, the samplers, a KV cell's size. A model file's
vocabulary can also be loaded alone (`VocabOnly`), to tokenize as a server of that file does.

The model is read-only once loaded, so these are safe off the worker thread (the HTTP side
tokenizes and applies the template while the worker decodes). Contexts are made from it
(`new_context`) and freed by their maker; `close` frees the model, last.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import llama_cpp as llama

from cacheproxy.embedded.tasks import EngineError, SamplingParams


@llama.llama_log_callback
def _drop_llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp logs every load and context creation to stderr; the proxy has its own log."""


def _backend() -> None:
    llama.llama_log_set(_drop_llama_log, None)
    llama.llama_backend_init()


def tokenize(vocab: Any, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """llama.cpp's tokenization of `text`, as llama-server's `common_tokenize` makes it."""
    data = text.encode()
    capacity = len(data) + 8
    buffer = (llama.llama_token * capacity)()
    count = llama.llama_tokenize(
        vocab, data, len(data), buffer, capacity, add_special, parse_special
    )
    if count < 0:
        buffer = (llama.llama_token * -count)()
        count = llama.llama_tokenize(
            vocab, data, len(data), buffer, -count, add_special, parse_special
        )
    return list(buffer[:count])


def token_piece(vocab: Any, token: int, special: bool) -> bytes:
    """The text llama.cpp writes for `token` (`special`: a special token as its own text)."""
    buffer = ctypes.create_string_buffer(64)
    length = llama.llama_token_to_piece(vocab, token, buffer, 64, 0, special)
    if length < 0:
        buffer = ctypes.create_string_buffer(-length)
        length = llama.llama_token_to_piece(vocab, token, buffer, -length, 0, special)
    return buffer.raw[:length]


class VocabOnly:
    """A model file's vocabulary, without its weights (megabytes, read in milliseconds):
    llama.cpp's own tokenizer for that model. Read-only once loaded, so it tokenizes on any
    thread; freed when the last reference goes (a thread tokenizing holds one)."""

    def __init__(self, path: Path) -> None:
        _backend()
        params = llama.llama_model_default_params()
        params.vocab_only = True
        handle = llama.llama_model_load_from_file(str(path).encode(), params)
        if not handle:
            raise EngineError(500, f"cannot load the vocabulary of {path}")
        self._vocab = llama.llama_model_get_vocab(handle)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self._vocab))
        weakref.finalize(self, llama.llama_model_free, handle)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return tokenize(self._vocab, text, add_special, parse_special)

    def token_piece(self, token: int) -> bytes:
        return token_piece(self._vocab, token, True)


class LlamaModel:
    def __init__(self, path: Path) -> None:
        _backend()
        self.handle = llama.llama_model_load_from_file(
            str(path).encode(), llama.llama_model_default_params()
        )
        if not self.handle:
            raise EngineError(500, f"cannot load model {path}")
        self._vocab = llama.llama_model_get_vocab(self.handle)
        self.n_vocab = llama.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = llama.llama_model_n_ctx_train(self.handle)
        self.kv_bytes_per_cell = kv_bytes_per_cell(self.handle)
        self.eog_tokens = tuple(
            token for token in range(self.n_vocab) if llama.llama_vocab_is_eog(self._vocab, token)
        )

    def new_context(self, params: Any, what: str = "the llama.cpp context") -> Any:
        ctx = llama.llama_init_from_model(self.handle, params)
        if not ctx:
            raise EngineError(500, f"cannot create {what}")
        return ctx

    def close(self) -> None:
        llama.llama_model_free(self.handle)

    def valid(self, tokens: Sequence[int]) -> bool:
        """Whether every id is one of the vocabulary's."""
        return not any(token < 0 or token >= self.n_vocab for token in tokens)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return tokenize(self._vocab, text, add_special, parse_special)

    def token_piece(self, token: int, special: bool = True) -> bytes:
        return token_piece(self._vocab, token, special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_piece(token) for token in tokens).decode(errors="replace")

    def meta(self, n_ctx: int) -> dict[str, int]:
        """What llama-server's GET /v1/models reports of the model (its `meta`), for slots of
        `n_ctx` tokens."""
        return {
            "vocab_type": int(llama.llama_vocab_type(self._vocab)),
            "n_vocab": self.n_vocab,
            "n_ctx": n_ctx,
            "n_ctx_train": int(self.n_ctx_train),
            "n_embd": int(llama.llama_model_n_embd(self.handle)),
            "n_params": int(llama.llama_model_n_params(self.handle)),
            "size": int(llama.llama_model_size(self.handle)),
        }

    def chat_template(self) -> str | None:
        template = llama.llama_model_chat_template(self.handle, None)
        return template.decode() if template else None

    def special_token_text(self, which: Literal["bos", "eos"]) -> str:
        token = (llama.llama_vocab_bos if which == "bos" else llama.llama_vocab_eos)(self._vocab)
        return self.token_piece(token).decode(errors="replace") if token >= 0 else ""

    @property
    def adds_bos(self) -> bool:
        return bool(llama.llama_vocab_get_add_bos(self._vocab))

    def make_sampler(self, sampling: SamplingParams) -> Any:
        """A sampler chain for one task (the task's slot frees it)."""
        chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        if sampling.ignore_eos and self.eog_tokens:
            biases = (llama.llama_logit_bias * len(self.eog_tokens))()
            for index, token in enumerate(self.eog_tokens):
                biases[index].token = token
                biases[index].bias = float("-inf")
            llama.llama_sampler_chain_add(
                chain,
                llama.llama_sampler_init_logit_bias(self.n_vocab, len(self.eog_tokens), biases),
            )
        if sampling.temperature <= 0.0:
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_greedy())
            return chain
        if sampling.top_k > 0:
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_k(sampling.top_k))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_p(sampling.top_p, 1))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_min_p(sampling.min_p, 1))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_temp(sampling.temperature))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_dist(sampling.seed))
        return chain


def kv_bytes_per_cell(model: Any) -> int:
    """Bytes of K and V one token takes over all layers, with the default f16 cache."""
    n_head = max(1, llama.llama_model_n_head(model))
    n_head_kv = llama.llama_model_n_head_kv(model)
    head_dim = llama.llama_model_n_embd(model) // n_head
    f16_bytes = 2
    return 2 * llama.llama_model_n_layer(model) * n_head_kv * head_dim * f16_bytes

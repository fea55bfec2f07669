"""Write a small GGUF with random weights, for tests, benchmarks and the demo (llama's architecture,
or Gemma 2's or Mamba's below).

The vocabulary (SentencePiece, 32k tokens) is copied from `models/ggml-vocab-llama-spm.gguf` of the
pinned llama.cpp sdist, so tokenization is real; the weights are seeded noise, so outputs are
meaningless but deterministic under greedy sampling. Sizes are arguments: the default is fast
(~15k prompt tokens/s on 2 cores, ~1 KiB of KV per token); `--size large` makes time measurable;
`--size kv-heavy` carries 64 KiB of KV per token, so that disk-tier costs have real proportions
(run with an f32 KV cache: `server_args` gives the flags).

`cacheproxy testbed make-model [--size small|large|kv-heavy]` prints the model's path. `fim=True`
writes a variant whose vocabulary declares fill-in-the-middle tokens, so that llama-server serves
`/infill` with it (the SentencePiece vocabulary has none, and the server refuses infill without
them). `chat_tokens=True` writes one whose vocabulary holds the chat template's `<|im_start|>` and
`<|im_end|>` as control tokens, as real chat models do (CHAT_TOKEN_IDS), so that the server
parses them out of a prompt. `--size swa` writes a Gemma-2-architecture model whose attention
layers alternate between a sliding window of 64 tokens and the whole context, as Gemma 2 and 3
and gpt-oss do: llama-server keeps such a model's KV cache otherwise (docs/disk-tier.md).
`--size recurrent` writes a Mamba-architecture model: no KV cache, a recurrent state per
sequence that cannot be cut short (docs/embedded.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from cacheproxy.provision.cache import cache_root, llama_cpp_source, locked, say

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 32768
    seed: int = 1234
    fim: bool = False  # declare fill-in-the-middle tokens (see FIM_TOKEN_IDS)
    chat_tokens: bool = False  # the chat template's markers as control tokens (CHAT_TOKEN_IDS)
    # attention head width; None: n_embd / n_head. Wider heads than the embedding allows give
    # many bytes of KV per token for little matmul work (llama's `attention.key_length`)
    head_dim: int | None = None
    # the KV cache type llama-server must be run with (`--cache-type-k/-v`; not in the file):
    # f32 holds twice the bytes of f16 for the same attention work
    kv_cache_type: str = "f16"
    # a sliding attention window (tokens): written as Gemma 2's architecture, whose every other
    # layer attends only to the window (None: llama's, every layer attends to all)
    sliding_window: int | None = None
    # a recurrent state of this many values a channel (Mamba's d_state), instead of attention
    recurrent_state: int | None = None

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer in the cache type: what a slot save writes per token."""
        element_bytes = KV_CACHE_TYPE_BYTES[self.kv_cache_type]
        return 2 * self.n_layer * self.n_head_kv * self.attention_head_dim * element_bytes

    @property
    def server_args(self) -> tuple[str, ...]:
        """The llama-server flags this model is meant to run with (its KV cache type)."""
        if self.kv_cache_type == "f16":  # llama-server's default
            return ()
        return ("--cache-type-k", self.kv_cache_type, "--cache-type-v", self.kv_cache_type)

    @property
    def name(self) -> str:
        dims = f"e{self.n_embd}-l{self.n_layer}-h{self.n_head}-kv{self.n_head_kv}-f{self.n_ff}"
        if self.head_dim is not None:
            dims += f"-d{self.head_dim}"
        variant = ("-fim" if self.fim else "") + ("-chatml" if self.chat_tokens else "")
        if self.recurrent_state is not None:
            dims = f"e{self.n_embd}-l{self.n_layer}-st{self.recurrent_state}"
            return f"tiny-mamba-{dims}-s{self.seed}{variant}"
        if self.sliding_window is not None:
            return f"tiny-gemma2-{dims}-w{self.sliding_window}-s{self.seed}{variant}"
        return f"tiny-llama-{dims}-s{self.seed}{variant}"

    @property
    def architecture(self) -> str:
        if self.recurrent_state is not None:
            return "mamba"
        return "llama" if self.sliding_window is None else "gemma2"


# The FIM roles given to three byte tokens (<0x00>, <0x01>, <0x02>) that no text tokenizes to:
# the weights are noise anyway, and llama-server only needs the ids to lay out an infill prompt.
FIM_TOKEN_IDS = {"fim_pre": 3, "fim_suf": 4, "fim_mid": 5}


# The chat template's markers given to the vocabulary's last two pieces (two rare CJK characters,
# which then tokenize to their bytes), as control tokens: llama-server parses them as one token.
CHAT_TOKEN_IDS = {31998: "<|im_start|>", 31999: "<|im_end|>"}
CONTROL_TOKEN_TYPE = 3


KV_CACHE_TYPE_BYTES = {"f16": 2, "f32": 4}
MAMBA_CONV_KERNEL = 4
MAMBA_TIME_STEP_RANK = 8

SIZES = {
    "small": ModelShape(n_embd=128, n_layer=4, n_head=4, n_head_kv=2, n_ff=384),
    "large": ModelShape(n_embd=768, n_layer=8, n_head=12, n_head_kv=6, n_ff=2048),
    # 64 KiB of KV per token (2 x 16 layers x 4 heads x 128 x 4 bytes of f32) on a tiny
    # embedding, so that saving and restoring a slot weigh against prefilling it as at real
    # size (see docs/testbed.md). Prefill is then mostly attention, whose work per KV byte
    # an f32 cache halves against f16, and as many query heads as KV heads keeps at its least;
    # the weights' matmuls are a small share (n_embd 64). 16 f16 layers of 256 wide took 2-3x
    # longer to prefill for the same bytes, 32 layers of 256 wide (the first kv-heavy) 3-6x.
    "kv-heavy": ModelShape(
        n_embd=64, n_layer=16, n_head=4, n_head_kv=4, n_ff=128, head_dim=128, kv_cache_type="f32"
    ),
    # the small shape with a 64-token sliding window on every other layer (Gemma 2's layout)
    "swa": ModelShape(n_embd=128, n_layer=4, n_head=4, n_head_kv=2, n_ff=384, sliding_window=64),
    # Mamba's layout at the small shape's width: a recurrent state, no attention
    "recurrent": ModelShape(
        n_embd=128, n_layer=4, n_head=0, n_head_kv=0, n_ff=0, recurrent_state=16
    ),
}


def server_args(size: str) -> tuple[str, ...]:
    """The llama-server flags the model of that size needs besides the model path."""
    return SIZES[size].server_args


def ensure_model(
    size: str = "small", seed: int | None = None, fim: bool = False, chat_tokens: bool = False
) -> Path:
    """Return the path of the generated model of that size, writing it first if needed.

    Another `seed` gives other weights of the same shape (a different model that no metadata
    tells apart); `fim` the same weights with fill-in-the-middle tokens declared; `chat_tokens`
    with the chat template's markers as control tokens."""
    shape = SIZES[size] if seed is None else dataclasses.replace(SIZES[size], seed=seed)
    shape = dataclasses.replace(shape, fim=fim, chat_tokens=chat_tokens)
    path = cache_root() / "models" / f"{shape.name}.gguf"
    return _written_once(path, f"model-{shape.name}", lambda: write_model(shape, path))


def _written_once(path: Path, lock: str, write: Callable[[], None]) -> Path:
    """`path`, written by `write` first unless it is there; one writer at a time (`lock`)."""
    if path.exists():
        return path
    with locked(lock):
        if not path.exists():
            write()
    return path


def model_folder(folder: Path, seeds: dict[str, int], size: str = "small") -> Path:
    """A folder for a router-mode llama-server (`--models-dir`): a model of `size` for each
    name, with weights of its own seed, linked as `<name>.gguf` (the router names a model
    after its file, without the extension). Returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, seed in seeds.items():
        link = folder / f"{name}.gguf"
        link.unlink(missing_ok=True)
        link.symlink_to(ensure_model(size, seed=seed))
    return folder


LORA_RANK = 8


def ensure_lora(size: str = "small", seed: int = 7) -> Path:
    """Return the path of a random LoRA adapter for the model of that size (its attention's
    Q, K and V, rank `LORA_RANK`; `seed`: other weights), writing it first if needed. Its
    weights are large beside the model's, so that a scale changes the answer."""
    shape = SIZES[size]
    path = cache_root() / "models" / f"lora-{shape.name}-r{LORA_RANK}-s{seed}.gguf"
    return _written_once(path, f"lora-{shape.name}-{seed}", lambda: write_lora(shape, seed, path))


def write_lora(shape: ModelShape, seed: int, path: Path) -> None:
    """A LoRA adapter GGUF as llama.cpp's `llama_adapter_lora_init` reads it: `general.type`
    "adapter", `adapter.type` "lora", its alpha, and an `.lora_a`/`.lora_b` pair a weight (A
    of shape (in, rank) and B of (rank, out), in ggml's order)."""
    rng = np.random.default_rng(seed)
    head_dim = shape.attention_head_dim
    outputs = {
        "attn_q": head_dim * shape.n_head,
        "attn_k": head_dim * shape.n_head_kv,
        "attn_v": head_dim * shape.n_head_kv,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, shape.architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(LORA_RANK))
    for layer in range(shape.n_layer):
        for weight, n_out in outputs.items():
            name = f"blk.{layer}.{weight}.weight"
            # numpy shapes are (out, in): GGUFWriter reverses them
            lora_a = rng.normal(0.0, 0.5, (LORA_RANK, shape.n_embd)).astype(np.float32)
            lora_b = rng.normal(0.0, 0.5, (n_out, LORA_RANK)).astype(np.float32)
            writer.add_tensor(f"{name}.lora_a", lora_a)
            writer.add_tensor(f"{name}.lora_b", lora_b)
    _write_out(writer, partial, path)
    say(f"LoRA adapter ready: {path}")


def write_model(shape: ModelShape, path: Path) -> None:
    vocab_path = llama_cpp_source() / "models" / "ggml-vocab-llama-spm.gguf"
    say(f"writing random-weight model {path.name} (vocab from {vocab_path.name})")
    vocab = gguf.GGUFReader(vocab_path)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")

    writer = gguf.GGUFWriter(partial, shape.architecture)
    writer.add_name(shape.name)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    if shape.recurrent_state is not None:
        writer.add_ssm_conv_kernel(MAMBA_CONV_KERNEL)
        writer.add_ssm_inner_size(2 * shape.n_embd)  # the only expansion llama.cpp takes
        writer.add_ssm_state_size(shape.recurrent_state)
        writer.add_ssm_time_step_rank(MAMBA_TIME_STEP_RANK)
    else:
        writer.add_rope_dimension_count(shape.attention_head_dim)
    if shape.head_dim is not None or shape.sliding_window is not None:
        writer.add_key_length(shape.attention_head_dim)
        writer.add_value_length(shape.attention_head_dim)
    if shape.sliding_window is not None:
        writer.add_sliding_window(shape.sliding_window)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _copy_tokenizer(vocab, writer, CHAT_TOKEN_IDS if shape.chat_tokens else {})
    if shape.fim:
        for role, token_id in FIM_TOKEN_IDS.items():
            writer.add_uint32(f"tokenizer.ggml.{role}_token_id", token_id)
    writer.add_chat_template(CHAT_TEMPLATE)

    tensors = _mamba_tensors if shape.recurrent_state is not None else _random_tensors
    for name, tensor in tensors(shape, n_vocab):
        writer.add_tensor(name, tensor)

    _write_out(writer, partial, path)
    say(f"model ready: {path} ({path.stat().st_size // (1 << 20)} MiB)")


def _write_out(writer: gguf.GGUFWriter, partial: Path, path: Path) -> None:
    """The GGUF `writer` holds, written to `partial` and renamed into place at `path` whole."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    partial.rename(path)


def _copy_tokenizer(
    vocab: gguf.GGUFReader, writer: gguf.GGUFWriter, control_tokens: dict[int, str]
) -> None:
    """The vocabulary as it is, but for the pieces of `control_tokens` (id: its text)."""
    for key, field in vocab.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value_types = field.types
        if value_types[0] == gguf.GGUFValueType.ARRAY:
            contents = field.contents()
            for token_id, text in control_tokens.items():
                if key == "tokenizer.ggml.tokens":
                    contents[token_id] = text
                elif key == "tokenizer.ggml.token_type":
                    contents[token_id] = CONTROL_TOKEN_TYPE
            writer.add_key_value(key, contents, value_types[0], sub_type=value_types[-1])
        else:
            writer.add_key_value(key, field.contents(), value_types[0])


def _random_tensors(shape: ModelShape, n_vocab: int) -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(shape.seed)
    head_dim = shape.attention_head_dim
    n_embd_q = head_dim * shape.n_head
    n_embd_kv = head_dim * shape.n_head_kv

    def matrix(rows: int, cols: int) -> np.ndarray:
        # numpy shape is (out, in); GGUFWriter reverses it into ggml's (in, out) order
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(shape.n_embd, dtype=np.float32)

    yield "token_embd.weight", matrix(n_vocab, shape.n_embd)
    for layer in range(shape.n_layer):
        block = f"blk.{layer}"
        yield f"{block}.attn_norm.weight", norm()
        yield f"{block}.attn_q.weight", matrix(n_embd_q, shape.n_embd)
        yield f"{block}.attn_k.weight", matrix(n_embd_kv, shape.n_embd)
        yield f"{block}.attn_v.weight", matrix(n_embd_kv, shape.n_embd)
        yield f"{block}.attn_output.weight", matrix(shape.n_embd, n_embd_q)
        yield f"{block}.ffn_norm.weight", norm()
        yield f"{block}.ffn_gate.weight", matrix(shape.n_ff, shape.n_embd)
        yield f"{block}.ffn_up.weight", matrix(shape.n_ff, shape.n_embd)
        yield f"{block}.ffn_down.weight", matrix(shape.n_embd, shape.n_ff)
        if shape.architecture == "gemma2":  # norms after attention and the feed-forward too
            yield f"{block}.post_attention_norm.weight", norm()
            yield f"{block}.post_ffw_norm.weight", norm()
    yield "output_norm.weight", norm()
    if shape.architecture == "llama":  # Gemma 2 reads its output through the embedding
        yield "output.weight", matrix(n_vocab, shape.n_embd)


def _mamba_tensors(shape: ModelShape, n_vocab: int) -> Iterator[tuple[str, np.ndarray]]:
    """Mamba's tensors (src/models/mamba.cpp): a state-space block a layer, no attention."""
    assert shape.recurrent_state is not None
    rng = np.random.default_rng(shape.seed)
    d_inner, d_state = 2 * shape.n_embd, shape.recurrent_state

    def matrix(rows: int, cols: int, kind: type = np.float16) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(kind)

    def vector(size: int, value: float) -> np.ndarray:
        return np.full(size, value, dtype=np.float32)

    yield "token_embd.weight", matrix(n_vocab, shape.n_embd)
    for layer in range(shape.n_layer):
        block = f"blk.{layer}"
        yield f"{block}.attn_norm.weight", vector(shape.n_embd, 1.0)
        yield f"{block}.ssm_in.weight", matrix(2 * d_inner, shape.n_embd)
        yield f"{block}.ssm_conv1d.weight", matrix(d_inner, MAMBA_CONV_KERNEL, np.float32)
        yield f"{block}.ssm_conv1d.bias", vector(d_inner, 0.0)
        yield f"{block}.ssm_x.weight", matrix(MAMBA_TIME_STEP_RANK + 2 * d_state, d_inner)
        yield f"{block}.ssm_dt.weight", matrix(d_inner, MAMBA_TIME_STEP_RANK)
        yield f"{block}.ssm_dt.bias", vector(d_inner, 0.0)
        yield f"{block}.ssm_a", -np.ones((d_inner, d_state), dtype=np.float32)
        yield f"{block}.ssm_d", vector(d_inner, 1.0)
        yield f"{block}.ssm_out.weight", matrix(shape.n_embd, d_inner)
    yield "output_norm.weight", vector(shape.n_embd, 1.0)

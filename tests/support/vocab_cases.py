"""The pinned llama.cpp tree's tokenizer tests (`models/ggml-vocab-*.gguf.inp` and `.out`): the
texts, and the ids each vocabulary is expected to make of them, read as its test-tokenizer-0
reads them."""

from __future__ import annotations

from pathlib import Path

from cacheproxy.provision.cache import llama_cpp_source

SOURCE = llama_cpp_source()
CASE_SEPARATOR = "\n__ggml_vocab_test__\n"


def tokenizer_cases() -> list[str]:
    """The distinct texts of the pinned tree's tokenizer tests, in a fixed order."""
    cases: dict[str, None] = {}
    for path in sorted((SOURCE / "models").glob("ggml-vocab-*.gguf.inp")):
        for case in path.read_text(encoding="utf-8").split(CASE_SEPARATOR):
            cases.setdefault(case.removesuffix("\n"), None)
    return list(cases)


def vocabularies_with_expected_ids() -> list[Path]:
    """The vocabulary files that come with their test texts and expected ids."""
    return sorted(
        path
        for path in (SOURCE / "models").glob("ggml-vocab-*.gguf")
        if Path(f"{path}.inp").is_file() and Path(f"{path}.out").is_file()
    )


def expected_ids(vocabulary: Path) -> list[tuple[str, list[int]]]:
    """Each test text of `vocabulary` and its ids (add_special and parse_special off), split
    as tests/test-tokenizer-0.cpp splits them: texts at the separator, one line of ids each."""
    raw = Path(f"{vocabulary}.inp").read_text(encoding="utf-8")
    texts = []
    start = 0
    while start < len(raw):
        end = raw.find(CASE_SEPARATOR, start)
        if end < 0:
            texts.append(raw[start:])
            break
        texts.append(raw[start:end])
        start = end + len(CASE_SEPARATOR)
    lines = Path(f"{vocabulary}.out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file's last newline ends the last line
    pairs = zip(texts, lines, strict=True)  # a text for each line of ids
    return [(text, [int(id_) for id_ in line.split()]) for text, line in pairs]

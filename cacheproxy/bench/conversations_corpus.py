"""Real multi-turn conversations, read from the `chatterbot-corpus` package (BSD-3-Clause, on
PyPI): its `chatterbot_corpus/data/<language>/*.yml` files each hold a `conversations:` list, every
conversation a list of utterances that alternate between two speakers, the first one asking.

Only conversations of at least three utterances are kept (a question, its answer and a follow-up:
the shortest that is multi-turn), and only those whose utterances are all non-empty strings (a
YAML scalar such as `42` would be read as a number; the corpus has none, a future version might).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

import yaml

CORPUS_PACKAGE = "chatterbot_corpus"
MIN_UTTERANCES = 3


@dataclass(frozen=True)
class RecordedConversation:
    """One recorded conversation: utterances 0, 2, 4, ... are the user's, 1, 3, ... the
    assistant's. `name`: where it comes from, `<language>/<file stem>/<index in the file>`."""

    name: str
    language: str
    utterances: tuple[str, ...]

    @property
    def turns(self) -> int:
        """Requests it makes: one per user utterance."""
        return (len(self.utterances) + 1) // 2


def data_folder() -> Traversable:
    return resources.files(CORPUS_PACKAGE) / "data"


def corpus_languages() -> list[str]:
    """The languages the installed corpus has (its data folders), sorted."""
    return sorted(entry.name for entry in data_folder().iterdir() if entry.is_dir())


def kept(utterances: object) -> tuple[str, ...] | None:
    if not isinstance(utterances, list) or len(utterances) < MIN_UTTERANCES:
        return None
    if not all(isinstance(text, str) and text.strip() for text in utterances):
        return None
    return tuple(utterances)


def file_conversations(language: str, stem: str, text: str) -> list[RecordedConversation]:
    document = yaml.safe_load(text)
    listed = document.get("conversations") if isinstance(document, dict) else None
    found = []
    for index, utterances in enumerate(listed or ()):
        if (usable := kept(utterances)) is not None:
            found.append(RecordedConversation(f"{language}/{stem}/{index}", language, usable))
    return found


def load_conversations(languages: tuple[str, ...]) -> list[RecordedConversation]:
    """Every multi-turn conversation of `languages`, in a fixed order (language, file, index)."""
    known = corpus_languages()
    unknown = sorted(set(languages) - set(known))
    if unknown:
        raise ValueError(f"the corpus has no language {unknown}; it has {known}")
    conversations = []
    for language in sorted(set(languages)):
        entries = (data_folder() / language).iterdir()
        files = sorted((entry for entry in entries if entry.name.endswith(".yml")), key=str)
        for entry in files:
            stem = entry.name.removesuffix(".yml")
            conversations += file_conversations(language, stem, entry.read_text(encoding="utf-8"))
    return conversations

"""Retrieval drafting in the manner of REST (He et al., 2024, "REST: Retrieval-Based Speculative
Decoding", NAACL): draft the continuation that most often follows the context's longest suffix in a
datastore of text the user points at (a source tree, a file, a JSONL corpus).

The datastore is tokenised once with the target's tokenizer into one token stream, documents
separated by :data:`SEPARATOR` (which no context token equals), and indexed by its suffix array.
A step takes the longest suffix of the sequence, of at most ``max_suffix`` and at least
``min_suffix`` tokens, that occurs in the stream; of its occurrences (at most ``max_matches``,
evenly spaced in suffix-array order) it reads the next ``k`` tokens of each, and drafts the
greedy most-frequent path through the trie of these continuations.

Worked example: with documents ``[5, 6, 7, 8]``, ``[5, 6, 7, 9]``, ``[5, 6, 7, 8, 1]`` and a
context ending in ``[.., 5, 6]``, the longest suffix found is ``[5, 6]`` (three occurrences); the
continuations are ``[7, 8]``, ``[7, 9]``, ``[7, 8, 1]``; the trie's most frequent first token is 7
(3 of 3), then 8 (2 of 3), then 1 (1 of 2): the draft is ``[7, 8, 1]`` for ``k = 3``.

REST verifies a token tree of the retrieved continuations; :class:`RetrievalDrafter` drafts one
chain (the trie's most frequent path), so its drafts go through the engine's chain verification
with one-hot draft distributions, exactly like prompt lookup (:class:`quickdraft.decoding.drafters.NGramDrafter`).
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np

from quickdraft.decoding.drafters import LookupDrafter
from quickdraft.errors import QuickdraftError

#: separates documents in the token stream; never equal to a context token (ids are >= 0)
SEPARATOR = -1
#: version of the ``.npz`` layout written by :meth:`RetrievalIndex.save`
INDEX_FORMAT = 1


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """``[N] int64``: the start positions of the suffixes of ``tokens [N]`` in lexicographic order
    (a suffix that is a prefix of another sorts first; :data:`SEPARATOR` sorts below every token).

    Built by libdivsufsort (``pydivsufsort``) where installed, O(N log N), about a second for
    3 million tokens; otherwise by :func:`suffix_array_numpy`.
    """
    tokens = np.ascontiguousarray(tokens)
    if tokens.ndim != 1:
        raise QuickdraftError(f"a token stream is one-dimensional, got shape {tokens.shape}")
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int64)
    try:
        from pydivsufsort import divsufsort
    except ImportError:  # pragma: no cover - pydivsufsort is a dependency
        return suffix_array_numpy(tokens)
    return np.asarray(divsufsort(tokens), dtype=np.int64)


def suffix_array_numpy(tokens: np.ndarray) -> np.ndarray:
    """:func:`suffix_array` by prefix doubling with numpy sorts (Manber and Myers): O(N log N) per
    round, one round per doubling of the longest repeated substring; fine up to a few million tokens."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    _, rank = np.unique(np.asarray(tokens, dtype=np.int64), return_inverse=True)  # [N] dense ranks
    rank = rank.astype(np.int64).ravel()
    span = 1
    while True:
        # the rank of the next ``span`` tokens; -1 past the end sorts a shorter suffix first
        second = np.full(n, -1, dtype=np.int64)
        second[: n - span] = rank[span:]
        order = np.lexsort((second, rank))
        a, b = rank[order], second[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate(([0], np.cumsum((a[1:] != a[:-1]) | (b[1:] != b[:-1]))))
        rank = new
        if rank.max() == n - 1 or span >= n:
            return order.astype(np.int64)
        span *= 2


def suffix_range(tokens: np.ndarray, suffixes: np.ndarray, query: list[int]) -> tuple[int, int]:
    """``(lo, hi)``: ``suffixes[lo:hi]`` are exactly the positions where ``query`` occurs in
    ``tokens`` (``lo == hi``: nowhere). Two binary searches, O(len(query) log N)."""
    m = len(query)

    def bound(strict: bool) -> int:
        lo, hi = 0, len(suffixes)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(suffixes[mid])
            head = tokens[start:start + m].tolist()
            if head < query or (strict and head == query):
                lo = mid + 1
            else:
                hi = mid
        return lo

    return bound(False), bound(True)


def most_frequent_path(continuations: np.ndarray) -> list[int]:
    """The greedy most-frequent path through the trie of ``continuations [M, K]`` (rows padded with
    :data:`SEPARATOR`): the most frequent first token, then the most frequent second token among
    the rows that start with it, and so on, while some row goes on. Ties go to the smaller id.

    >>> most_frequent_path(np.array([[7, 8, -1], [7, 9, -1], [7, 8, 1]]))
    [7, 8, 1]
    """
    alive = np.ones(len(continuations), dtype=bool)
    path: list[int] = []
    for column in continuations.T:  # [M] the d-th token of every continuation
        candidates = column[alive & (column != SEPARATOR)]
        if len(candidates) == 0:
            break
        ids, counts = np.unique(candidates, return_counts=True)
        token = int(ids[np.argmax(counts)])
        path.append(token)
        alive &= column == token
    return path


class RetrievalIndex:
    """A tokenised datastore and its suffix array.

    Parameters
    ----------
    tokens:
        ``[N] int32``: the documents' token ids, each document followed by :data:`SEPARATOR`.
    suffixes:
        ``[N] int64``: :func:`suffix_array` of ``tokens`` (computed when not given).
    """

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray | None = None) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)
        if not np.any(tokens != SEPARATOR):
            raise QuickdraftError("the datastore holds no tokens: point --datastore at text")
        self.tokens = tokens
        self.suffixes = suffix_array(tokens) if suffixes is None else np.asarray(suffixes, dtype=np.int64)
        if self.suffixes.shape != tokens.shape:
            raise QuickdraftError(f"a suffix array of {len(self.suffixes)} entries for {len(tokens)} tokens")
        self.max_id = int(tokens.max())  # the largest token id (the target's vocabulary must hold it)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_token_lists(cls, documents: list[list[int]]) -> "RetrievalIndex":
        """The index of ``documents`` (token-id lists), joined with :data:`SEPARATOR`."""
        documents = [list(doc) for doc in documents if len(doc)]
        if any(min(doc) < 0 for doc in documents):
            raise QuickdraftError("datastore token ids must be >= 0")
        stream = [token for doc in documents for token in doc + [SEPARATOR]]
        return cls(np.array(stream, dtype=np.int32))

    @classmethod
    def from_texts(cls, texts: list[str], tokenizer) -> "RetrievalIndex":
        """The index of ``texts`` tokenised with ``tokenizer`` (no special tokens added)."""
        texts = [t for t in texts if t]
        if not texts:
            raise QuickdraftError("the datastore holds no text")
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return cls.from_token_lists(encoded)

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], tokenizer, field: str = "text") -> "RetrievalIndex":
        """The index of the datastore at ``path`` (:func:`read_datastore`), or the index saved there
        by :meth:`save` (a ``.npz`` file)."""
        if Path(path).suffix == ".npz":
            return cls.load(path)
        return cls.from_texts(read_datastore(path, field), tokenizer)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tokens and suffix array to ``path`` (numpy ``.npz``), for :meth:`load`."""
        np.savez(path, format=np.int64(INDEX_FORMAT), tokens=self.tokens, suffixes=self.suffixes)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "RetrievalIndex":
        """The index :meth:`save` wrote to ``path``."""
        if not Path(path).is_file():
            raise QuickdraftError(f"no datastore index at {path}")
        try:
            with np.load(path) as data:
                if int(data["format"]) != INDEX_FORMAT:
                    raise QuickdraftError(f"{path}: index format {int(data['format'])}, this version reads {INDEX_FORMAT}")
                return cls(data["tokens"], data["suffixes"])
        except (OSError, KeyError, ValueError) as err:
            raise QuickdraftError(f"{path} is not a datastore index saved by quickdraft: {err}") from None

    def find(self, query: list[int]) -> np.ndarray:
        """``[M] int64``: every position where ``query`` occurs (sorted by what follows)."""
        lo, hi = suffix_range(self.tokens, self.suffixes, list(query))
        return self.suffixes[lo:hi]

    def continuations(self, query: list[int], k: int, max_matches: int = 5000) -> np.ndarray:
        """``[M, k] int32``: the ``k`` tokens after each occurrence of ``query`` (at most
        ``max_matches``, evenly spaced in suffix-array order), :data:`SEPARATOR` from a document's
        end on."""
        lo, hi = suffix_range(self.tokens, self.suffixes, list(query))
        if hi - lo > max_matches:
            picks = lo + (np.arange(max_matches) * (hi - lo)) // max_matches
        else:
            picks = np.arange(lo, hi)
        starts = self.suffixes[picks] + len(query)  # [M]
        where = starts[:, None] + np.arange(k)  # [M, k]
        out = np.where(where < len(self.tokens), self.tokens[np.minimum(where, len(self.tokens) - 1)], SEPARATOR)
        ended = np.maximum.accumulate(out == SEPARATOR, axis=1)  # past a document's end
        return np.where(ended, SEPARATOR, out).astype(np.int32)

    def longest_suffix(self, context: list[int], max_suffix: int = 16, min_suffix: int = 2) -> int:
        """The length of the longest suffix of ``context`` (between ``min_suffix`` and ``max_suffix``
        tokens) that occurs in the datastore, 0 if none does. A suffix that occurs has every shorter
        suffix occur too, so the length is found by binary search."""
        lo, hi = min_suffix - 1, min(max_suffix, len(context))  # lo: known to occur (or below min)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = suffix_range(self.tokens, self.suffixes, context[-mid:])
            if found[1] > found[0]:
                lo = mid
            else:
                hi = mid - 1
        return lo if lo >= min_suffix else 0

    def draft(self, context: list[int], k: int, max_suffix: int = 16, min_suffix: int = 2,
              max_matches: int = 5000) -> list[int]:
        """Up to ``k`` tokens: the most frequent continuation (:func:`most_frequent_path`) of the
        longest suffix of ``context`` found in the datastore; where that suffix only ends documents,
        of the next shorter one that is continued. ``[]`` where no suffix of ``min_suffix`` tokens occurs."""
        n = self.longest_suffix(context, max_suffix, min_suffix)
        while n >= min_suffix:
            path = most_frequent_path(self.continuations(context[-n:], k, max_matches))
            if path:
                return path
            n -= 1
        return []


def read_datastore(path: str | os.PathLike[str], field: str = "text") -> list[str]:
    """The documents of the datastore at ``path``: a text file (one document), a ``.jsonl`` file
    (the ``field`` of each line's object), a directory (each file under it, recursively, in
    name order; hidden files and folders, files that are not UTF-8 text are skipped), or a glob
    pattern (``src/**/*.py``: each matching file, in name order, read as in a directory)."""
    if any(c in str(path) for c in "*?["):
        matches = sorted(Path(m) for m in glob.glob(str(path), recursive=True))
        texts = [t for m in matches if m.is_file() for t in _read_file(m, field, strict=False)]
        if not any(texts):
            raise QuickdraftError(f"datastore pattern {path} matches no text files")
        return texts
    root = Path(path)
    if not root.exists():
        raise QuickdraftError(f"datastore {path} does not exist")
    if root.is_file():
        return _read_file(root, field, strict=True)
    texts: list[str] = []
    for directory, folders, files in os.walk(root):
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                texts.extend(_read_file(Path(directory) / name, field, strict=False))
    if not any(texts):
        raise QuickdraftError(f"datastore {path} holds no text files")
    return texts


def _read_file(path: Path, field: str, strict: bool) -> list[str]:
    """The documents of one file; a file that is not UTF-8 text is an error when ``strict``, else skipped."""
    data = path.read_bytes()
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, 0, 1, "a NUL byte: binary data")
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        if strict:
            raise QuickdraftError(f"datastore {path} is not UTF-8 text") from None
        return []
    if path.suffix != ".jsonl":
        if strict and not text.strip():
            raise QuickdraftError(f"datastore {path} is empty")
        return [text]
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise QuickdraftError(f"{path}:{number}: not a JSON object ({err.msg})") from None
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise QuickdraftError(f"{path}:{number}: no text field {field!r} (choose one with --datastore-field)")
        docs.append(value)
    if strict and not any(docs):
        raise QuickdraftError(f"datastore {path} holds no text in field {field!r}")
    return docs


class RetrievalDrafter(LookupDrafter):
    """REST-style retrieval (method ``rest``): draft the datastore's most frequent continuation of
    the sequence's longest suffix found there (:meth:`RetrievalIndex.draft`). No model, no forwards.

    The draft distributions are one-hot at the retrieved tokens, so every rule verifies them
    exactly, as for prompt lookup; :class:`quickdraft.decoding.drafters.NGramModelDrafter` over this drafter
    is ``rest_sd`` (retrieval, the draft model where it finds nothing).
    """

    name = "rest"

    def __init__(self, vocab_size: int, index: RetrievalIndex, max_suffix: int = 16, min_suffix: int = 2,
                 max_matches: int = 5000) -> None:
        if not (1 <= min_suffix <= max_suffix):
            raise QuickdraftError(f"need 1 <= min_suffix <= max_suffix, got {min_suffix}, {max_suffix}")
        if max_matches < 1:
            raise QuickdraftError(f"max_matches must be >= 1, got {max_matches}")
        if index.max_id >= vocab_size:
            raise QuickdraftError(f"the datastore holds token id {index.max_id}, beyond the target's {vocab_size} "
                                  "token ids: index it with the target's tokenizer")
        self.vocab_size = vocab_size
        self.index = index
        self.max_suffix = max_suffix
        self.min_suffix = min_suffix
        self.max_matches = max_matches

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to ``k`` retrieved tokens following ``seq`` (``[]``: nothing found)."""
        return self.index.draft(seq, k, self.max_suffix, self.min_suffix, self.max_matches)

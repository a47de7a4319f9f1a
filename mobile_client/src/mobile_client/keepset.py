"""The keep set: the tokens both phone drafters may propose (paper §3.3, Appendix A; FR-Spec style).

The drafters' output layers are cut to the keep set (86,089 of 262,144 ids for Gemma 4): the special
tokens, the 256 byte tokens (which can spell any string), configurable always-keep id ranges (the paper
keeps all 4,678 Hangul tokens), and then the tokens most frequent in a corpus until the size target is
reached. The verifier still samples from the full vocabulary, so the restriction costs acceptance only and
exact mode stays lossless; drafters still *read* any committed token (their input tables stay complete).

Id maps, both ways:

    keep_to_full  [n]           int64, sorted ascending: keep index -> full id (``KeepSet.ids``)
    full_to_keep  [vocab_size]  int32: full id -> keep index, -1 for dropped ids

The hash sent at session start is ``sha256(b"hyco-keepset-v1\\0" + u64le(vocab_size) + u32le(ids))`` in
hex, over the sorted ids; two keep sets with the same ids and vocabulary size hash equal.

>>> ks = build_keep_set({7: 5, 9: 3, 4: 3, 8: 1}, size=4, vocab_size=12, special_ids=[0])
>>> ks.ids.tolist(), ks.full_to_keep[[0, 4, 7, 8, 9]].tolist()
([0, 4, 7, 9], [0, 1, 2, -1, 3])
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from vllm_hyco.errors import KeepSetError

HASH_PREFIX = b"hyco-keepset-v1\0"
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True, eq=False)
class KeepSet:
    """A sorted set of full-vocabulary ids with both id maps and a stable hash."""

    ids: np.ndarray  # [n] int64, sorted ascending, unique, in [0, vocab_size)
    vocab_size: int
    meta: dict[str, Any] = field(default_factory=dict)  # how it was built (counts per part); not hashed

    @classmethod
    def from_ids(cls, ids: Iterable[int], vocab_size: int, meta: Mapping[str, Any] | None = None) -> KeepSet:
        arr = np.unique(np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64))
        if vocab_size <= 0:
            raise KeepSetError(f"vocab_size must be positive, got {vocab_size}")
        if arr.size and (arr[0] < 0 or arr[-1] >= vocab_size):
            raise KeepSetError(f"keep-set ids must lie in [0, {vocab_size}), got {arr[0]}..{arr[-1]}")
        arr.setflags(write=False)
        return cls(arr, int(vocab_size), dict(meta or {}))

    def __len__(self) -> int:
        return int(self.ids.size)

    def __contains__(self, token: int) -> bool:
        return 0 <= token < self.vocab_size and self.full_to_keep[token] >= 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepSet) and self.vocab_size == other.vocab_size and np.array_equal(
            self.ids, other.ids)

    def __hash__(self) -> int:
        return hash(self.hash)

    @property
    def keep_to_full(self) -> np.ndarray:
        """[n] int64: keep index -> full id (the ``keep_ids`` the tree builder takes)."""
        return self.ids

    @cached_property
    def full_to_keep(self) -> np.ndarray:
        """[vocab_size] int32: full id -> keep index, -1 where the id is dropped."""
        out = np.full(self.vocab_size, -1, dtype=np.int32)
        out[self.ids] = np.arange(self.ids.size, dtype=np.int32)
        out.setflags(write=False)
        return out

    @cached_property
    def hash(self) -> str:
        """sha256 hex over the prefix, u64le(vocab_size), the sorted ids as u32le (sent at session start)."""
        h = hashlib.sha256(HASH_PREFIX)
        h.update(int(self.vocab_size).to_bytes(8, "little"))
        h.update(self.ids.astype("<u4").tobytes())
        return h.hexdigest()

    @property
    def hash_bytes(self) -> bytes:
        """The 32-byte digest (the start frame's ``keep_set_hash``)."""
        return bytes.fromhex(self.hash)

    def to_keep(self, full_ids: Any) -> np.ndarray:
        """Map full ids to keep indices (-1 for dropped ids)."""
        return self.full_to_keep[np.asarray(full_ids, dtype=np.int64)]

    def to_full(self, keep_idx: Any) -> np.ndarray:
        """Map keep indices to full ids."""
        return self.ids[np.asarray(keep_idx, dtype=np.int64)]

    def coverage(self, counts: Any) -> float:
        """Share of the token occurrences in ``counts`` ([vocab_size] or {id: count}) the keep set holds."""
        c = _as_counts(counts, self.vocab_size)
        total = int(c.sum())
        return float(c[self.ids].sum() / total) if total else 1.0

    # ------------------------------------------------------------------------------------------ save / load

    def save(self, path: str | Path) -> Path:
        """Write ``.json`` (ids as a list) or ``.npz`` (ids as an array), by suffix; both record the hash."""
        path = Path(path)
        if path.suffix == ".npz":
            np.savez(path, ids=self.ids.astype(np.int64), vocab_size=np.int64(self.vocab_size),
                     hash=np.array(self.hash), meta=np.array(json.dumps(self.meta, sort_keys=True)))
        elif path.suffix == ".json":
            doc = {"format": "hyco-keepset-v1", "vocab_size": self.vocab_size, "size": len(self),
                   "hash": self.hash, "meta": self.meta, "ids": self.ids.tolist()}
            path.write_text(json.dumps(doc) + "\n", encoding="utf-8")
        else:
            raise KeepSetError(f"keep-set file {path} must end in .json or .npz")
        return path

    @classmethod
    def load(cls, path: str | Path, *, expected_hash: str | None = None) -> KeepSet:
        """Read a file written by ``save``; raise ``KeepSetError`` on a hash or ``expected_hash`` mismatch."""
        path = Path(path)
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                ids, vocab, saved = z["ids"], int(z["vocab_size"]), str(z["hash"])
                meta = json.loads(str(z["meta"])) if "meta" in z else {}
        elif path.suffix == ".json":
            doc = json.loads(path.read_text(encoding="utf-8"))
            ids, vocab, saved, meta = doc["ids"], int(doc["vocab_size"]), doc["hash"], doc.get("meta", {})
        else:
            raise KeepSetError(f"keep-set file {path} must end in .json or .npz")
        ks = cls.from_ids(ids, vocab, meta)
        for want, what in ((saved, f"the hash recorded in {path}"), (expected_hash, "the expected hash")):
            if want is not None and want != ks.hash:
                raise KeepSetError(f"keep set {path} hashes to {ks.hash[:12]}..., not {what} {want[:12]}...; "
                                   "rebuild it or load the file the session was started with")
        return ks


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> np.ndarray:
    """[vocab_size] int64 occurrence counts over token-id sequences."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq in sequences:
        arr = np.asarray(seq if isinstance(seq, np.ndarray) else list(seq), dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            raise KeepSetError(f"token ids must lie in [0, {vocab_size}), got {arr.min()}..{arr.max()}")
        counts += np.bincount(arr, minlength=vocab_size)
    return counts


def _as_counts(source: Any, vocab_size: int) -> np.ndarray:
    """Counts from a {id: count} mapping or a [vocab_size] array/tensor."""
    if isinstance(source, Mapping):
        counts = np.zeros(vocab_size, dtype=np.int64)
        for tok, n in source.items():
            if not 0 <= int(tok) < vocab_size:
                raise KeepSetError(f"token id {tok} in the counts is outside [0, {vocab_size})")
            counts[int(tok)] += int(n)
        return counts
    arr = np.asarray(source.cpu().numpy() if hasattr(source, "cpu") else source)
    if arr.ndim != 1 or arr.shape[0] != vocab_size:
        raise KeepSetError(f"token counts must have shape [{vocab_size}], got {arr.shape}; pass id sequences "
                           "as a list of sequences")
    return arr.astype(np.int64)


def _ranges(ranges: Iterable[tuple[int, int]], vocab_size: int) -> np.ndarray:
    parts = []
    for lo, hi in ranges:
        if not 0 <= lo <= hi <= vocab_size:
            raise KeepSetError(f"always-keep range [{lo}, {hi}) is not inside [0, {vocab_size})")
        parts.append(np.arange(lo, hi, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def build_keep_set(source: Any, *, size: int, vocab_size: int, special_ids: Iterable[int] = (),
                   byte_ids: Iterable[int] = (),
                   always_keep_ranges: Iterable[tuple[int, int]] = ()) -> KeepSet:
    """The keep set of ``size`` ids: specials, byte tokens and ``always_keep_ranges`` (half-open id ranges)
    first, then the most frequent other tokens of ``source`` (ties to the lower id).

    ``source``: {id: count}, a [vocab_size] counts array/tensor, or an iterable of token-id sequences.
    Tokens never seen are not added, so a small corpus gives a keep set smaller than ``size``
    (``meta["frequent"]`` says how many came from counts). Forced ids beyond ``size`` raise.
    """
    if isinstance(source, Mapping) or hasattr(source, "shape"):
        counts = _as_counts(source, vocab_size)
    else:
        counts = count_tokens(source, vocab_size)
    special = KeepSet.from_ids(special_ids, vocab_size).ids
    byte = KeepSet.from_ids(byte_ids, vocab_size).ids
    forced = np.unique(np.concatenate([special, byte, _ranges(always_keep_ranges, vocab_size)]))
    room = size - forced.size
    if room < 0:
        raise KeepSetError(f"{forced.size} special, byte and always-keep ids exceed the size target {size}")
    free = np.ones(vocab_size, dtype=bool)
    free[forced] = False
    cand = np.nonzero(free & (counts > 0))[0]
    cand = cand[np.lexsort((cand, -counts[cand]))][:room]
    meta = {"special": int(special.size), "byte": int(byte.size), "forced": int(forced.size),
            "frequent": int(cand.size), "size_target": int(size)}
    ks = KeepSet.from_ids(np.concatenate([forced, cand]), vocab_size, meta)
    ks.meta["coverage"] = ks.coverage(counts)
    return ks


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 style byte-level BPE: the printable character that stands for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def byte_token_ids(vocab: Mapping[str, int]) -> list[int]:
    """Ids of the 256 byte tokens of a tokenizer vocabulary ({token string: id}).

    SentencePiece byte fallback (Gemma: ``<0x00>``..``<0xFF>``) when present, else the byte-level BPE
    alphabet (one character per byte). Raises if the vocabulary has neither complete set.
    """
    hexed = {int(m.group(1), 16): i for t, i in vocab.items() if (m := _HEX_BYTE.match(t))}
    if len(hexed) == 256:
        return sorted(hexed.values())
    alphabet = _byte_level_alphabet()
    found = {alphabet[t]: i for t, i in vocab.items() if t in alphabet}
    if len(found) == 256:
        return sorted(found.values())
    raise KeepSetError(f"vocabulary has {len(hexed)} <0xNN> tokens and {len(found)} byte-level characters; "
                       "pass byte_ids explicitly")


def char_range_token_ids(vocab: Mapping[str, int], ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Ids of tokens with at least one character in the code-point ranges (inclusive), e.g. Hangul
    syllables ``[(0xAC00, 0xD7A3)]``. Works on SentencePiece vocabularies (plain text pieces)."""
    return sorted(i for t, i in vocab.items() if any(lo <= ord(ch) <= hi for ch in t for lo, hi in ranges))


def tokenizer_parts(tokenizer: Any) -> tuple[list[int], list[int], int]:
    """(special_ids, byte_ids, vocab_size) of a Hugging Face tokenizer (duck-typed, no import)."""
    vocab = tokenizer.get_vocab()
    special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []))
    for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            special.add(int(i))
    return sorted(special), byte_token_ids(vocab), len(vocab)


def keep_set_from_texts(tokenizer: Any, texts: Iterable[str], *, size: int,
                        always_keep_ranges: Iterable[tuple[int, int]] = (),
                        vocab_size: int | None = None) -> KeepSet:
    """``build_keep_set`` over a Hugging Face tokenizer and the answer texts of a corpus (paper: the
    assistant turns of UC-tr), with the tokenizer's special and byte tokens. ``vocab_size`` defaults to the
    tokenizer's (pass the model's when its embedding table is larger)."""
    special, byte, n = tokenizer_parts(tokenizer)
    seqs = (tokenizer(t, add_special_tokens=False).input_ids for t in texts)
    return build_keep_set(seqs, size=size, vocab_size=vocab_size or n, special_ids=special, byte_ids=byte,
                          always_keep_ranges=always_keep_ranges)

"""A validation split made in code (``data.val_split``), stratified and seeded.

The examples of an image folder or a record set are ordered by class, then (a folder) by the
file's path relative to its split folder, so within class ``c`` they are positions
``0 .. n_c - 1`` whatever order the file system listed them in; a record set converted from
the folder holds them in the same order. :func:`stratified_split` holds out
``round(fraction * n_c)`` of each class (halves round up), at least one and at most
``n_c - 1`` when ``n_c >= 2``; a class of a single example keeps it for training (it has no
validation example). Which positions: those of the smallest keys ``mix(seed, c, position)``, a
fixed 64-bit integer hash (SplitMix64's finaliser), so the split is a seeded permutation of
each class with exact counts. It depends only on the seed and the per-class counts: the same on
every host, for any number of workers or processes, in a resumed run and in ``jaxcnn-eval``,
and for a folder and its records (which have only indices) when the conversion left no image
out (``jaxcnn-data convert`` skips undecodable ones, which moves the positions after them). A
keyed hash of each file's path would keep a file on its side when others are added, but records
hold no paths, and an added file changes the run's fingerprint anyway (a resume refuses it);
exact counts won.
"""
from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014), on uint64 arrays (wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def held_out_count(n: int, fraction: float) -> int:
    """How many of a class's ``n`` examples are held out: ``round(fraction * n)`` (halves up),
    clipped to ``[1, n - 1]`` when ``n >= 2``; 0 for a class of one example (kept for training)."""
    if n < 2:
        return 0
    return min(max(int(np.floor(fraction * n + 0.5)), 1), n - 1)


def class_keys(seed: int, class_index: int, n: int) -> np.ndarray:
    """The keys that order positions ``0 .. n - 1`` of class ``class_index`` (uint64)."""
    with np.errstate(over="ignore"):
        base = _mix(np.uint64(seed) * _GOLDEN + np.uint64(class_index + 1))
        return _mix(base ^ ((np.arange(n, dtype=np.uint64) + np.uint64(1)) * _GOLDEN))


def stratified_split(counts, fraction: float, seed: int):
    """Splits examples laid out by class (class ``c`` at ``sum(counts[:c]) + 0 .. counts[c] - 1``).

    Arguments:
        counts: examples per class, in class order.
        fraction: the share of each class held out, in ``(0, 1)``.
        seed: the data seed (a non-negative int below 2**64).

    Returns:
        ``(train, val)``: sorted int64 arrays of example indices, disjoint, together every index.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"val_split must be in (0, 1), got {fraction!r}")
    train, val, start = [], [], 0
    for c, n in enumerate(int(n) for n in counts):
        order = np.argsort(class_keys(seed, c, n), kind="stable")
        held = np.zeros(n, bool)
        held[order[:held_out_count(n, fraction)]] = True
        positions = np.arange(start, start + n, dtype=np.int64)
        train.append(positions[~held])
        val.append(positions[held])
        start += n
    empty = np.zeros(0, np.int64)
    return np.concatenate(train or [empty]), np.concatenate(val or [empty])


def per_class_counts(labels, num_classes: int) -> list[int]:
    """Examples per class of a label list."""
    return np.bincount(np.asarray(labels, np.int64), minlength=num_classes).tolist()


class Subset:
    """Examples ``indices`` of a source (torch's ``Subset``): ``subset[i]`` is
    ``source[indices[i]]``; the class names are the source's. Picklable when the source is (it
    travels to loader workers)."""

    def __init__(self, source, indices, split: str):
        self.source = source
        self.indices = np.asarray(indices, np.int64)
        self.split = split
        self.class_names = source.class_names

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.source[int(self.indices[i])]

    @property
    def name(self) -> str:
        return f"{self.source.name} ({self.split} side of data.val_split)"

    @property
    def path(self) -> str:
        return self.source.path

    def fingerprint(self) -> dict:
        """``{"images", "sha256"}``: SHA-256 over the source's fingerprint hash, a NUL, and
        each index as 8 little-endian bytes."""
        import hashlib

        digest = hashlib.sha256(self.source.fingerprint()["sha256"].encode() + b"\0")
        digest.update(self.indices.astype("<i8").tobytes())
        return {"images": len(self), "sha256": digest.hexdigest()}

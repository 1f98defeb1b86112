"""The order of the shard loader's samples: which source each global sample comes from, and which
window of that source, from a seed alone (no table in memory, nothing random at run time).

    global sample g ──► source s:  the Weyl sequence u_g = frac(c + g·φ) (φ = golden ratio, c from the seed)
                                   falls into s's share of [0, 1): every run of n consecutive samples holds
                                   each source's share of them to within a few samples
                    ──► j:         g is the j-th sample drawn from s (the counts are the stream's position)
                    ──► window:    epoch j // N_s, then a keyed permutation of the N_s windows of s, new
                                   each epoch (a 4-round Feistel network on the next even power of two,
                                   cycle-walked into range: O(1) memory at any N_s)

A position is (g, counts per source); it is the same on every data-parallel rank, which is what lets a run
resume at another number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_M64 = (1 << 64) - 1
_PHI = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: the Weyl step (odd)


def mix(*values: int) -> int:
    """A 64-bit hash of the values (splitmix64's finalizer, folded over them)."""
    z = 0
    for v in values:
        z = (z ^ (v & _M64)) + _PHI & _M64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M64
        z ^= z >> 31
    return z


def permute(i: int, n: int, key: int) -> int:
    """A bijection of range(n) chosen by `key`: i -> its place in a shuffled order."""
    if not 0 <= i < n:
        raise IndexError(f"permute: {i} is not in range({n})")
    if n == 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, shift = (1 << half) - 1, 64 - half
    keys = _round_keys(key)
    x = i
    while True:  # cycle-walking: a value past n goes through the network again until it lands in range
        left, right = x >> half, x & mask
        for k in keys:  # round function: the top `half` bits of a 64-bit multiplicative hash of (right, k)
            h = (right ^ k) * _PHI & _M64
            h = (h ^ (h >> 29)) * 0xBF58476D1CE4E5B9 & _M64
            left, right = right, left ^ (h >> shift)
        x = (left << half) | right
        if x < n:
            return x


_KEYS: dict[int, tuple[int, ...]] = {}


def _round_keys(key: int) -> tuple[int, ...]:
    if key not in _KEYS:
        if len(_KEYS) > 4096:  # one entry per (source, epoch) in use: a bound, never reached in practice
            _KEYS.clear()
        _KEYS[key] = tuple(mix(key, r) for r in range(4))
    return _KEYS[key]


@dataclass(frozen=True)
class Position:
    """Where the global stream stands: `samples` drawn so far, `counts[s]` of them from source s."""

    samples: int
    counts: tuple[int, ...]


class Mixture:
    """Sources picked by weight along the global stream (see the module docstring)."""

    def __init__(self, weights: list[float], seed: int):
        p = np.asarray(weights, dtype=np.float64)
        p = p / p.sum()
        # Source s owns [bounds[s-1], bounds[s]) of the 2^64 integers u_g ranges over.
        self.bounds = np.array([min(int(b * 2.0**64), _M64) for b in np.cumsum(p)[:-1]], dtype=np.uint64)
        self.offset = np.uint64(mix(seed, 0x5EED))
        self.num_sources = len(p)

    def start(self) -> Position:
        return Position(0, (0,) * self.num_sources)

    def take(self, at: Position, count: int) -> tuple[np.ndarray, np.ndarray, Position]:
        """The next `count` global samples from `at`: their sources [count], each one's index within
        its source [count] (the j above), and the position after them."""
        g = np.arange(at.samples, at.samples + count, dtype=np.uint64)
        u = g * np.uint64(_PHI) + self.offset  # wraps mod 2^64: frac(c + g·φ) in 64-bit fixed point
        sources = np.searchsorted(self.bounds, u, side="right")
        indices = np.empty(count, dtype=np.int64)
        counts = list(at.counts)
        for s in range(self.num_sources):
            picked = np.flatnonzero(sources == s)
            indices[picked] = counts[s] + np.arange(len(picked))
            counts[s] += len(picked)
        return sources, indices, Position(at.samples + count, tuple(counts))

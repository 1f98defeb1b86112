"""A synthetic token stream that a model can learn: walks on a fixed sparse Markov chain.

Every token has `successors` likely next tokens with geometric weights (1, 1/2, 1/4, ...),
drawn once from `seed` and shared by all ranks. A model that learns the chain reaches
about the chain's entropy (1.3 nats for 4 successors) instead of ln(vocab) (7.6 for
2048), within a few dozen steps. Sample i of data-parallel rank r comes from its own
generator seeded by (seed, r, i), so the state to checkpoint is one counter and ranks
never see the same sample.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import IterableDataset


def markov_chain(vocab_size: int, successors: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """next_tokens [V, s] int64 and their probabilities [V, s]."""
    g = torch.Generator().manual_seed(seed)
    next_tokens = torch.randint(0, vocab_size, (vocab_size, successors), generator=g)
    weights = 0.5 ** torch.arange(successors, dtype=torch.float64)
    return next_tokens, (weights / weights.sum()).expand(vocab_size, -1).contiguous()


def chain_entropy(successors: int) -> float:
    """Entropy per token (nats) of the chain: the lowest loss a perfect model reaches."""
    w = [0.5**i for i in range(successors)]
    p = [x / sum(w) for x in w]
    return -sum(x * math.log(x) for x in p)


class SyntheticMarkovDataset(IterableDataset):
    """Yields ({"input": tokens[:-1]}, labels = tokens[1:]), each [seq_len] int64."""

    def __init__(self, vocab_size: int, seq_len: int, dp_rank: int, successors: int = 4, seed: int = 1234):
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.seed = seed
        self.vocab_size = vocab_size
        next_tokens, self.probs = markov_chain(vocab_size, successors, seed)
        self.next_tokens = next_tokens.tolist()  # plain lists: the walk below is sequential
        self.sample_idx = 0

    def _sample(self, idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, self.dp_rank, idx)) & 0x7FFF_FFFF_FFFF)
        choices = torch.multinomial(self.probs[0], self.seq_len, replacement=True, generator=g).tolist()
        token = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        tokens = [token]
        for choice in choices:
            token = self.next_tokens[token][choice]
            tokens.append(token)
        return torch.tensor(tokens, dtype=torch.int64)

    def __iter__(self):
        while True:
            tokens = self._sample(self.sample_idx)
            self.sample_idx += 1
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state: dict) -> None:
        self.sample_idx = state["sample_idx"]

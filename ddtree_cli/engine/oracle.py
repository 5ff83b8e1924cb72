"""A test drafter: the real drafter runs (so its cost is real), then its logits are replaced
by logits peaked on a known continuation of each prompt, with controlled noise.

With random weights the drafter never agrees with the target, so speculative decoding would
only ever accept the bonus token. Knowing the target's own greedy output for a prompt (from
an AR run), this hook puts the true next token at draft rank 0, 1 or 2 with chosen
probabilities: rank 0 everywhere gives full-block acceptance (deep paths; the tree's
overhead per round shows on its own in benchmarks), ranks 1-2 make DFlash's chain stop
where DDTree can still accept through a sibling. It changes only what the drafter proposes,
never what the target verifies, so outputs must stay equal to AR's.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

PEAK = 10.5


class PeakedDraftHook:
    def __init__(
        self,
        references: dict[tuple[int, ...], list[int]],
        rank_probs: tuple[float, float, float] = (1.0, 0.0, 0.0),
        noise: float = 1.0,
        seed: int = 0,
    ):
        self.references = references
        self.rank_probs = torch.tensor(rank_probs, dtype=torch.float32)
        self.noise = noise
        self.seed = seed
        self._gen: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor, seqs: Seq) -> torch.Tensor:
        b, width, vocab = logits.shape
        device = logits.device
        if self._gen is None or self._gen.device != device:
            self._gen = torch.Generator(device=device).manual_seed(self.seed)
        gen = self._gen
        truth_rows = []
        for seq in seqs:
            ref = self.references.get(tuple(seq.prompt), [])
            k = len(seq.output)  # drafted position j predicts output index k + j
            row = ref[k : k + width]
            truth_rows.append(row + [-1] * (width - len(row)))
        truth = torch.tensor(truth_rows, dtype=torch.long).to(device, non_blocking=True)
        unknown = torch.randint(vocab, (b, width), device=device, generator=gen)
        truth = torch.where(truth < 0, unknown, truth).unsqueeze(-1)
        ranks = torch.multinomial(
            self.rank_probs.to(device).expand(b * width, 3), 1, replacement=True, generator=gen
        ).view(b, width, 1)
        out = torch.randn(b, width, vocab, device=device, generator=gen, dtype=torch.float32)
        out *= self.noise
        # Two distinct decoys, both different from the true token.
        off1 = 1 + torch.randint(vocab - 1, (b, width, 1), device=device, generator=gen)
        off2 = 1 + (
            off1 + torch.randint(vocab - 2, (b, width, 1), device=device, generator=gen)
        ) % (vocab - 1)
        decoy1, decoy2 = (truth + off1) % vocab, (truth + off2) % vocab
        out.scatter_(2, decoy1, torch.where(ranks >= 1, PEAK - 0.5, out.gather(2, decoy1)))
        out.scatter_(2, decoy2, torch.where(ranks >= 2, PEAK - 1.5, out.gather(2, decoy2)))
        out.scatter_(2, truth, PEAK - 1.5 * ranks.float())
        return out.to(logits.dtype)

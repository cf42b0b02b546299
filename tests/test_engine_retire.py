"""Rows retired from the decoder as they end (``sample(..., retire=True)``, the gateway engine's sampler) on real
tiny GPT-2 and Llama models: calls whose rows end at very different steps (per-row budgets, EOS) sample the same
ids as the static batch, exactly, with log-probs and entropies within 1e-5, under per-row generators, one batch
generator and greedy decoding; and the later steps really forward fewer rows."""

from __future__ import annotations

import pytest
import torch
from test_rollout import EOS, PAD, left_padded_prompts, tiny_gpt2, tiny_llama

from shifu.generation import decode
from shifu.generation.rollout import SamplingParams, policy_forward, sample

pytestmark = pytest.mark.unit

BUDGETS = [2, 19, 5, 11, 1, 16]


class Budgets:
    """``stop`` for :func:`sample`: row b ends at its ``BUDGETS[b]``-th token."""

    def __call__(self, tokens: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        return (tokens.shape[1] >= torch.tensor(BUDGETS)) & running


def run(model, retire: bool, draw: str, moves: list):
    ids, mask = left_padded_prompts(lengths=(7, 3, 9, 1, 5, 4))
    params = SamplingParams(max_new_tokens=max(BUDGETS), temperature=0.9, greedy=draw == "greedy")
    if draw == "rows":
        generator = [torch.Generator().manual_seed(10 + b) for b in range(len(BUDGETS))]
    else:
        generator = torch.Generator().manual_seed(3)
    moves.clear()
    out = sample(
        model, ids, mask, params, EOS, PAD, generator, with_log_probs=True, stop=Budgets(), retire=retire
    )
    return ids, mask, out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("draw", ["rows", "batch", "greedy"])
def test_retired_rows_sample_what_the_static_batch_samples(arch, draw, monkeypatch):
    model = {"gpt2": tiny_gpt2, "llama": tiny_llama}[arch]()
    moves = []
    move = decode._FastDecoder.move

    def counted(self, source, target):
        moves.append((source, target))
        move(self, source, target)

    monkeypatch.setattr(decode._FastDecoder, "move", counted)
    ids, mask, static = run(model, False, draw, moves)
    assert moves == []
    _, _, retired = run(model, True, draw, moves)
    assert moves  # rows left the decoder before the call ended
    m = static.response_mask
    assert torch.equal(m, retired.response_mask) and torch.equal(static.response_ids, retired.response_ids)
    lengths = m.sum(1).tolist()
    assert len(set(lengths)) > 2  # rows ended at different steps
    for name in ("log_probs", "entropy"):
        a, b = getattr(static, name)[m], getattr(retired, name)[m]
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    # and the trainer's recomputation of the retired call's rows (at T = 0.9, greedy or not)
    full = torch.cat([ids, retired.response_ids], 1)
    want = policy_forward(model, full, torch.cat([mask, m.long()], 1), ids.shape[1], 0.9)[0]
    torch.testing.assert_close(retired.log_probs[m], want[m], rtol=0, atol=1e-5)

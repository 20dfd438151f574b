"""The draft-model drafter on tiny random models: its proposals, and exact speculative decoding."""

from __future__ import annotations

import pytest
import torch

from graphserving.runtime.engine.spec_decode.acceptance import AcceptanceStats
from graphserving.runtime.engine.spec_decode.draft_model import DraftModelDrafter
from graphserving.runtime.engine.spec_decode.drafter import PAD_DRAFT, DraftRequest
from spec_support import PagedLoop, Request, tiny_model

VOCAB = 300


def peaked(seed: int = 0, layers: int = 2, noise: float = 0.0):
    """A tiny model with sharp logits (lm_head x 40), its lm_head perturbed by ``noise``."""
    model = tiny_model(seed=seed, layers=layers)
    with torch.no_grad():
        model.lm_head.mul_(40)
        if noise:
            model.lm_head.add_(torch.randn(model.lm_head.shape, generator=torch.Generator().manual_seed(9)) * noise)
    return model


@pytest.fixture(scope="module")
def target():
    return peaked()


def requests(params: dict) -> list[Request]:
    return [Request([5, 6, 7, 8, 9, 10, 5, 6, 7], 24, seed=3, params=params),
            Request([20, 21, 22, 20, 21], 16, seed=11, params=params),
            Request([40, 41], 20, seed=12345, params=params)]


def test_a_draft_model_identical_to_the_target_is_always_accepted_greedily(target):
    stats = AcceptanceStats(3)
    spec = PagedLoop(target).speculative(requests(dict(temperature=0.0)), DraftModelDrafter(peaked(), 3, VOCAB), stats)
    assert spec == PagedLoop(target).plain(requests(dict(temperature=0.0)))
    assert stats.acceptance_rate == 1.0
    assert stats.acceptance_rate_per_position == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9)], ids=["greedy", "seeded"])
def test_a_different_draft_model_changes_nothing_but_the_step_count(target, params):
    stats = AcceptanceStats(3)
    drafter = DraftModelDrafter(peaked(noise=0.5), 3, VOCAB)
    spec = PagedLoop(target).speculative(requests(params), drafter, stats)
    assert spec == PagedLoop(target).plain(requests(params))
    assert 0 < stats.acceptance_rate < 1


def test_a_sampling_draft_model_equal_to_the_target_is_always_accepted(target):
    """q == p (same model, same temperature): min(1, p / q) = 1 at every draft."""
    stats = AcceptanceStats(3)
    drafter = DraftModelDrafter(peaked(), 3, VOCAB, temperature=1.0)
    out = PagedLoop(target).speculative(requests(dict(temperature=1.0)), drafter, stats)
    assert [len(o) for o in out] == [24, 16, 20]
    assert stats.acceptance_rate == 1.0


def test_sampled_drafts_are_reproducible_per_seed_and_carry_their_distribution():
    drafter = DraftModelDrafter(tiny_model(), 4, VOCAB, temperature=1.0)  # flat logits: seeds matter
    batch = [DraftRequest([1, 2, 3, 4], 4, seed=5, step=2), DraftRequest([9, 8], 2, seed=6, step=0),
             DraftRequest([7], 0, seed=7)]
    first, again = drafter.propose(batch, "cpu"), drafter.propose(batch, "cpu")
    assert torch.equal(first.token_ids, again.token_ids)
    assert first.num_drafts.tolist() == [4, 2, 0]
    assert first.token_ids[1, 2:].tolist() == [PAD_DRAFT] * 2 and first.token_ids[2].tolist() == [PAD_DRAFT] * 4
    torch.testing.assert_close(first.probs[0].sum(dim=-1), torch.ones(4))
    drawn = first.probs[0].gather(-1, first.token_ids[0][:, None])
    assert (drawn > 0).all()
    other_seed = drafter.propose([DraftRequest([1, 2, 3, 4], 4, seed=50, step=2)], "cpu")
    assert not torch.equal(other_seed.token_ids[0], first.token_ids[0])


def test_greedy_drafts_are_the_draft_models_greedy_continuation():
    model = peaked(noise=0.5)
    proposal = DraftModelDrafter(model, 3, VOCAB).propose([DraftRequest([5, 6, 7], 3)], "cpu")
    assert proposal.probs is None
    expected = PagedLoop(model).plain([Request([5, 6, 7], 3, params=dict(temperature=0.0))])[0]
    assert proposal.token_ids[0].tolist() == expected


def test_drafts_stop_at_the_draft_models_last_position():
    model = peaked()
    proposal = DraftModelDrafter(model, 3, VOCAB).propose([DraftRequest(list(range(254)), 3)], "cpu")
    assert proposal.num_drafts.tolist() == [2]  # positions 254 and 255 of 256


def test_a_draft_model_of_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        DraftModelDrafter(peaked(), 3, target_vocab_size=49152)


def test_a_negative_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        DraftModelDrafter(peaked(), 3, VOCAB, temperature=-0.1)


def test_contexts_larger_than_the_draft_cache_are_refused_naming_the_setting():
    drafter = DraftModelDrafter(peaked(), 3, VOCAB, num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        drafter.propose([DraftRequest(list(range(20)), 3)], "cpu")

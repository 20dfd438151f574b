"""Verification of drafts: greedy acceptance, rejection sampling's distribution, the RNG contract.

The statistical tests draw 20,000 verifications of a 5-token vocabulary with a fixed seed and
compare the emitted tokens with the target distribution p by a chi-square test; each also checks
that the same test rejects the draft distribution q, so it would fail if q leaked into the output.
"""

from __future__ import annotations

import pytest
import torch

from graphserving.runtime.engine.sampler import counter_uniform, sample
from graphserving.runtime.engine.spec_decode.acceptance import AcceptanceStats
from graphserving.runtime.engine.spec_decode.drafter import PAD_DRAFT, DraftProposal, pad_drafts
from graphserving.runtime.engine.spec_decode.ngram import NgramDrafter
from graphserving.runtime.engine.spec_decode.rejection import (
    accepted_prefix,
    expand_sampling_tensors,
    target_probs,
    verify,
)
from spec_support import PagedLoop, Request, sampling_tensors, tiny_model

V = 5


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observed ``counts`` [V] under ``probs`` [V] (Pearson's statistic, V - 1 dof)."""
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    return float(1 - torch.distributions.Chi2(torch.tensor(float(len(probs) - 1))).cdf(statistic))


# ---------------------------------------------------------------------- greedy acceptance

def test_accepted_prefix_is_the_longest_prefix_matching_the_target():
    target = torch.tensor([[4, 1, 2, 3], [4, 1, 2, 3], [4, 1, 2, 3], [4, 1, 2, 3]])
    drafts = torch.tensor([[4, 1, 0], [0, 1, 2], [4, 1, 2], [4, 1, 2]])
    num_drafts = torch.tensor([3, 3, 3, 1])
    assert accepted_prefix(target, drafts, num_drafts).tolist() == [2, 0, 3, 1]


def greedy_logits(argmaxes: list[list[int]]) -> torch.Tensor:
    """Logits [R * (k + 1), V] whose row argmaxes are ``argmaxes`` (request after request)."""
    rows = [t for request in argmaxes for t in request]
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(rows)), rows] = 10.0
    return logits


def test_greedy_verification_emits_accepted_drafts_then_the_targets_token():
    logits = greedy_logits([[3, 1, 4], [2, 2, 0], [1, 0, 0]])
    proposal = pad_drafts([[3, 0], [2, 2], []], 2, "cpu")
    t = expand_sampling_tensors(sampling_tensors(3, V, temperature=0.0), proposal.token_ids, proposal.num_drafts, V)
    out = verify(logits, t, proposal)
    assert out.num_accepted.tolist() == [1, 2, 0]
    assert out.num_emitted.tolist() == [2, 3, 1]
    # request 0: draft 3 accepted, then the target's 1 where the draft said 0; request 1: both
    # drafts and the bonus token 0; request 2: no drafts, the target's token
    assert out.token_ids.tolist() == [[3, 1, PAD_DRAFT], [2, 2, 0], [1, PAD_DRAFT, PAD_DRAFT]]


def test_a_padded_draft_is_rejected_even_when_the_target_agrees_with_its_input():
    logits = greedy_logits([[0, 0]])  # the argmax is token 0, the placeholder padded rows run
    proposal = DraftProposal(token_ids=torch.tensor([[0]]), num_drafts=torch.tensor([0]))
    t = expand_sampling_tensors(sampling_tensors(1, V, temperature=0.0), proposal.token_ids, proposal.num_drafts, V)
    assert verify(logits, t, proposal).num_accepted.tolist() == [0]


def test_logits_of_the_wrong_row_count_are_refused():
    proposal = pad_drafts([[1, 2]], 2, "cpu")
    t = expand_sampling_tensors(sampling_tensors(1, V), proposal.token_ids, proposal.num_drafts, V)
    with pytest.raises(ValueError, match="need 3"):
        verify(torch.zeros(2, V), t, proposal)


# ---------------------------------------------------------------------- the rows' sampling tensors

def test_expanded_rows_advance_the_rng_counter_and_count_earlier_drafts_as_output():
    t = sampling_tensors(2, V, seeds=[7, 9], steps=[4, 0], output=[[1], []], rep=1.5)
    t.do_penalties = True
    proposal = pad_drafts([[2, 3], [4]], 2, "cpu")
    rows = expand_sampling_tensors(t, proposal.token_ids, proposal.num_drafts, V)
    assert rows.seeds.tolist() == [7, 7, 7, 9, 9, 9]
    assert rows.steps.tolist() == [4, 5, 6, 0, 1, 2]
    assert rows.repetition_penalty.tolist() == [1.5] * 6
    outputs = [sorted(x for x in row if x != V) for row in rows.output_token_ids.tolist()]
    assert outputs == [[1], [1, 2], [1, 2, 3], [], [4], [4]]


def test_target_probs_are_what_the_sampler_draws_from():
    gen = torch.Generator().manual_seed(3)
    rows = 64
    logits = torch.randn(rows, V, generator=gen) * 2
    t = sampling_tensors(rows, V, temperature=[0.0, 0.5, 1.0, 1.7] * 16, top_k=[V, 3, 2, V] * 16,
                         top_p=[1.0, 0.9, 1.0, 0.6] * 16, min_p=[0.0, 0.0, 0.1, 0.05] * 16, rep=1.2, presence=0.3,
                         frequency=0.1, seeds=list(range(rows)), steps=5, output=[[1, 1, 2]] * rows,
                         bias={4: -1.0})
    t.do_penalties = True
    probs = target_probs(logits, t)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(rows))
    noise = -torch.log(counter_uniform(t.seeds, t.steps, V)).float()
    assert torch.equal((probs / noise).argmax(dim=-1), sample(logits, t).token_ids)


# ---------------------------------------------------------------------- the target distribution

P = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
P1 = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])  # the target at position 1 (context-independent here)
Q = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.5])  # the draft distribution, deliberately different
N = 20_000


def _draws(probs: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.multinomial(probs.expand(N, V), 1, replacement=True,
                             generator=torch.Generator().manual_seed(seed)).squeeze(1)


def _verify_many(with_q: bool):
    """N requests (seeds 0 .. N-1), k = 2, drafts drawn from Q; returns the VerifyOutput."""
    drafts = torch.stack([_draws(Q, 1), _draws(Q, 2)], dim=1)
    logits = torch.log(torch.stack([P, P1, P]).repeat(N, 1))
    probs = Q.expand(N, 2, V).clone() if with_q else None
    proposal = DraftProposal(token_ids=drafts, num_drafts=torch.full((N,), 2), probs=probs)
    t = expand_sampling_tensors(sampling_tensors(N, V, seeds=list(range(N)), steps=11), drafts,
                                proposal.num_drafts, V)
    return verify(logits, t, proposal), drafts


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-distribution", "point-mass"])
def test_emitted_tokens_follow_the_target_not_the_draft(with_q):
    out, drafts = _verify_many(with_q)
    first = torch.bincount(out.token_ids[:, 0], minlength=V).float()
    assert chi_square_p_value(first, P) > 1e-3
    second = out.token_ids[out.num_emitted >= 2, 1]
    assert chi_square_p_value(torch.bincount(second, minlength=V).float(), P1) > 1e-3
    # the same test on the drafts themselves (what a leak would emit) fails by far
    assert chi_square_p_value(torch.bincount(drafts[:, 0], minlength=V).float(), P) < 1e-12
    # acceptance at position 0: sum(min(p, q)) against q; against a point mass on x ~ q, E[p(x)]
    expected = torch.minimum(P, Q).sum() if with_q else (P * Q).sum()
    assert abs(float((out.num_accepted >= 1).float().mean()) - float(expected)) < 0.015


def test_rejection_sampling_with_q_equal_to_p_accepts_every_draft():
    drafts = torch.stack([_draws(P, 3), _draws(P, 4)], dim=1)
    proposal = DraftProposal(token_ids=drafts, num_drafts=torch.full((N,), 2), probs=P.expand(N, 2, V).clone())
    logits = torch.log(P).repeat(3 * N, 1)
    t = expand_sampling_tensors(sampling_tensors(N, V, seeds=list(range(N))), drafts, proposal.num_drafts, V)
    assert verify(logits, t, proposal).num_accepted.tolist() == [2] * N


def test_emitted_logprobs_are_the_raw_model_logprobs_of_the_emitted_tokens():
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(5))
    proposal = DraftProposal(token_ids=torch.tensor([[1, 2], [0, 4], [3, 3]]), num_drafts=torch.tensor([2, 1, 0]),
                             probs=torch.full((3, 2, V), 1.0 / V))
    t = expand_sampling_tensors(sampling_tensors(3, V, seeds=[1, 2, 3], num_logprobs=2), proposal.token_ids,
                                proposal.num_drafts, V)
    out = verify(logits, t, proposal)
    expected = torch.log_softmax(logits, dim=-1).view(3, 3, V)
    for r, n in enumerate(out.num_emitted.tolist()):
        for j in range(n):
            assert float(out.logprobs[r, j]) == pytest.approx(float(expected[r, j, out.token_ids[r, j]]), abs=1e-6)
    assert out.top_token_ids.shape == (3, 3, 2)


# ---------------------------------------------------------------------- with the real model and sampler

BANNED = 7


class BannedDrafter:
    """Proposes k copies of a token the target gives probability 0 (``logit_bias`` -inf): every
    draft is rejected. ``with_q``: as distributions (a point mass in ``probs``)."""

    def __init__(self, k: int, vocab: int, with_q: bool):
        self.num_speculative_tokens, self.vocab, self.with_q = k, vocab, with_q

    def propose(self, requests, device):
        proposal = pad_drafts([[BANNED] * min(self.num_speculative_tokens, r.max_drafts) for r in requests],
                              self.num_speculative_tokens, device)
        if not self.with_q:
            return proposal
        probs = torch.zeros(len(requests), self.num_speculative_tokens, self.vocab)
        probs[..., BANNED] = 1.0
        return DraftProposal(proposal.token_ids, proposal.num_drafts, probs)


def _requests(params: dict) -> list[Request]:
    return [Request([5, 6, 7, 8, 9, 10, 5, 6, 7], 24, seed=3, params=params),
            Request([20, 21, 22, 20, 21], 16, seed=11, params=params),
            Request([40, 41], 20, seed=12345, params=params)]


@pytest.fixture(scope="module")
def peaked_model():
    """A random tiny model whose logits are sharp enough (lm_head x 40) to repeat itself: drafts
    are accepted under sampling too."""
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.mul_(40)
    return model


@pytest.mark.parametrize("with_q", [False, True], ids=["point-mass", "draft-distribution"])
def test_forced_zero_acceptance_gives_exactly_the_plain_samplers_tokens(peaked_model, with_q):
    params = dict(temperature=0.9, top_p=0.95, bias={BANNED: float("-inf")})
    plain = PagedLoop(peaked_model).plain(_requests(params))
    stats = AcceptanceStats(3)
    spec = PagedLoop(peaked_model).speculative(_requests(params), BannedDrafter(3, 300, with_q), stats)
    assert spec == plain
    assert stats.proposed_tokens > 0 and stats.accepted_tokens == 0


@pytest.mark.parametrize("params", [
    pytest.param(dict(temperature=0.0), id="greedy"),
    pytest.param(dict(temperature=0.8, top_p=0.9), id="seeded"),
    pytest.param(dict(temperature=1.0, top_k=50, rep=1.3, frequency=0.2, presence=0.1), id="seeded-penalties"),
])
def test_ngram_speculation_emits_the_non_speculative_tokens_exactly(peaked_model, params):
    plain = PagedLoop(peaked_model).plain(_requests(params))
    stats = AcceptanceStats(4)
    spec = PagedLoop(peaked_model).speculative(_requests(params), NgramDrafter(4), stats)
    assert spec == plain
    assert stats.accepted_tokens > 0  # the drafts were really used
    assert stats.verifications < sum(len(out) for out in plain)  # fewer passes than tokens

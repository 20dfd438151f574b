"""Whether a batch verifies (runtime/engine/spec_decode/policy.py) and what a verification pass
costs (spec_decode/costs.py): real acceptance windows, shadow windows replaying the drafter over
decoded tokens, the batch rule, the measured cost ratio."""

import pytest
import torch

from graphserving.runtime.engine.spec_decode.costs import DECODE, SMOOTHING, VERIFY, PassCosts
from graphserving.runtime.engine.spec_decode.ngram import NgramDrafter
from graphserving.runtime.engine.spec_decode.policy import (
    ACCEPTANCE_WINDOW,
    SHADOW_INTERVAL,
    UNJUDGED_ACCEPTANCE,
    UNMEASURED_VERIFICATION_COST,
    DraftHistory,
    expected_acceptance,
    next_history,
    shadow_due,
    shadow_review,
    shadow_window,
    verification_pays,
)


def test_a_full_window_sets_the_acceptance_and_starts_over():
    h = None
    for i in range(ACCEPTANCE_WINDOW - 1):
        h = next_history(h, 4, 2, 10 + i)
        assert h.acceptance is None and h.reviewed_at == 10 + i
    h = next_history(h, 4, 0, 100)
    assert h == DraftHistory(acceptance=6 / ACCEPTANCE_WINDOW, reviewed_at=100)
    for _ in range(ACCEPTANCE_WINDOW):
        h = next_history(h, 4, 0, 120)
    assert h == DraftHistory(acceptance=0.0, reviewed_at=120)  # the last window counts, not an average


def test_a_verification_without_drafts_leaves_the_history_alone_unless_counted():
    h = DraftHistory(3, 12, 2, reviewed_at=40)
    assert next_history(h, 0, 0, 50) is h
    # 2 accepted in 3 verifications, then one whose drafter found nothing (it paid for its rows)
    assert next_history(h, 0, 0, 50, counted=True) == DraftHistory(acceptance=0.5, reviewed_at=50)


def test_a_shadow_window_replays_the_verifications_prompt_lookup_would_have_run():
    drafter = NgramDrafter(4)
    # from length 3: [1, 2, 3] drafts nothing (no earlier occurrence), accepted 0, next at 4;
    # [1, 2, 3, 9]: nothing; [.., 9, 1]: "1" occurred at 0, drafts [2, 3, 9, 1], all equal, next at 10
    # then at 10 fewer than k = 4 decoded tokens follow: the window ends with 3 verifications
    tokens = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 9, 1]
    assert shadow_window(tokens, 3, drafter) == (3, 4)
    # a periodic context from the start: every draft is accepted; the window stops where fewer
    # than k decoded tokens follow (lengths 6 and 11 fit into 16 tokens, 16 does not)
    assert shadow_window([7, 8] * 8, 6, drafter) == (2, 8)
    # text that never repeats: nothing is accepted, one token per verification
    assert shadow_window(list(range(100, 140)), 20, drafter) == (ACCEPTANCE_WINDOW, 0)


def test_a_shadow_review_judges_a_request_that_decoded_an_interval_without_verifying():
    drafter = NgramDrafter(4)
    judged = DraftHistory(2, 8, 1, acceptance=0.0, reviewed_at=10)
    novel = list(range(100, 140))
    assert not shadow_due(judged, 10 + SHADOW_INTERVAL - 1) and shadow_due(judged, 10 + SHADOW_INTERVAL)
    assert shadow_review(judged, novel, 10 + SHADOW_INTERVAL - 1, drafter) is judged  # the interval is not up
    # the window in progress is dropped: the shadow window judges the latest tokens
    assert shadow_review(judged, novel, 10 + SHADOW_INTERVAL, drafter) == DraftHistory(
        acceptance=0.0, reviewed_at=10 + SHADOW_INTERVAL)
    # the last SHADOW_INTERVAL tokens repeat with period 3: from their start 0, 0, 4 and 4 accepted
    looping = novel + [5, 6, 7] * 6
    assert shadow_review(judged, looping, 10 + SHADOW_INTERVAL, drafter) == DraftHistory(
        acceptance=2.0, reviewed_at=10 + SHADOW_INTERVAL)
    # a request never judged is due after its first SHADOW_INTERVAL output tokens
    assert shadow_review(None, novel, SHADOW_INTERVAL - 1, drafter) is None
    assert shadow_review(None, looping, SHADOW_INTERVAL, drafter).acceptance == 2.0


def test_a_batch_verifies_when_its_expected_drafts_pay_for_the_pass():
    assert expected_acceptance(None) == UNJUDGED_ACCEPTANCE == 1.0
    assert expected_acceptance(DraftHistory(acceptance=0.25)) == 0.25
    # unmeasured: a pass costs 2 decode steps, so a batch needs 1 accepted draft per request
    assert UNMEASURED_VERIFICATION_COST == 2.0
    assert verification_pays([1.0], None) and not verification_pays([0.9], None)
    assert verification_pays([0.0, 0.0, 4.0, 0.0], None) and not verification_pays([0.0, 0.0, 3.0, 0.0], None)
    # measured at 1.5 decode steps: half an accepted draft per request suffices
    assert verification_pays([0.5, 0.5], 1.5) and not verification_pays([0.5, 0.4], 1.5)
    # a pass as cheap as a decode step pays whenever anything is expected, never with nothing
    assert verification_pays([0.01, 0.0], 1.0) and not verification_pays([0.0, 0.0], 1.0)
    assert not verification_pays([], None)


def test_the_cost_ratio_is_a_moving_average_of_each_kind_per_batch_size():
    costs = PassCosts()
    assert costs.ratio(8) is None
    costs.observe(VERIFY, 8, 1.5)
    assert costs.ratio(8) is None  # no decode step timed at 8 rows yet
    costs.observe(DECODE, 8, 1.0)
    assert costs.ratio(8) == 1.5 and costs.ratio(4) is None
    costs.observe(DECODE, 8, 2.0)
    assert costs.ms_per_step[(DECODE, 8)] == pytest.approx(1.0 + SMOOTHING * (2.0 - 1.0))


def test_runs_off_cuda_are_not_timed():
    costs = PassCosts()
    with costs.timing(DECODE, 1, 8, torch.device("cpu")):
        torch.ones(4).sum()
    assert costs.pending == [] and costs.ms_per_step == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_timed_cuda_run_is_folded_in_once_its_events_fired():
    costs = PassCosts()
    x = torch.randn(2048, 2048, device="cuda")
    with costs.timing(VERIFY, 2, 4, torch.device("cuda")):
        for _ in range(4):
            x = x @ x.T / 2048
    with costs.timing(DECODE, 2, 4, torch.device("cuda")):
        for _ in range(4):
            x = (x @ x.T / 2048)[:, :]
    torch.cuda.synchronize()
    ratio = costs.ratio(2)
    assert ratio is not None and 0.2 < ratio < 5 and costs.pending == []
    assert costs.ms_per_step[(VERIFY, 2)] > 0


def _row(acceptance=None, num_output=3, max_tokens=64, finished=False, grammar=False):
    from graphserving.runtime.engine.scheduler import ScheduledSequence
    from graphserving.runtime.engine.sequence import SamplingParams, Sequence, SequenceStatus

    seq = Sequence(seq_id="s", request_id="r", index=0, prompt_token_ids=list(range(10, 15)),
                   params=SamplingParams(max_tokens=max_tokens), seed=0, max_tokens=max_tokens,
                   matcher=object() if grammar else None)
    seq.output_token_ids = list(range(50, 50 + num_output))
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.draft_history = DraftHistory(acceptance=acceptance, reviewed_at=num_output)
    if finished:
        seq.status = SequenceStatus.FINISHED
    return ScheduledSequence.of(seq, 1)


def test_the_decoder_counts_only_rows_that_will_still_decode():
    from graphserving.runtime.engine.speculative import SpeculativeDecoder, max_drafts

    decoder = SpeculativeDecoder(NgramDrafter(4), max_model_len=512)
    live = _row(acceptance=1.2)
    assert decoder.pays([live], [4])
    # a finished row, a grammar row and a row the queued steps finish emit nothing either way
    for other in (_row(acceptance=0.0, finished=True), _row(acceptance=0.0, num_output=60)):
        rows = [live, other]
        assert decoder.pays(rows, [max_drafts(r, 4, 8) for r in rows], after=8)
    rows = [live, _row(grammar=True)]
    assert not decoder.pays(rows, [max_drafts(r, 4) for r in rows])  # 1.2 < 2 rows x (2 - 1)
    # a measured cost decides instead of the assumed one
    decoder.costs.observe(VERIFY, 2, 1.5)
    decoder.costs.observe(DECODE, 2, 1.0)
    assert decoder.pays(rows, [max_drafts(r, 4) for r in rows])  # 1.2 >= 2 x 0.5
    # a plain run continues while verifying does not pay once the queued steps are done
    near_end = _row(acceptance=3.0, num_output=55)  # 9 tokens left: 8 queued steps leave its last one
    assert max_drafts(near_end, 4, 8) == 0 and decoder.may_continue_plain([near_end], 8)
    assert not decoder.may_continue_plain([near_end], 0)


def test_only_a_host_replayable_drafter_is_replayed_by_shadow_windows():
    from graphserving.runtime.engine.speculative import SpeculativeDecoder

    class DevicePassDrafter:  # e.g. a draft model: no host_replayable attribute
        num_speculative_tokens = 4

        def propose(self, requests, device):
            raise AssertionError("a shadow window must not call a drafter that is not host_replayable")

    row = _row(acceptance=0.0, num_output=40)
    row.seq.draft_history = DraftHistory(acceptance=0.0, reviewed_at=0)
    SpeculativeDecoder(DevicePassDrafter(), max_model_len=512).review([row])
    assert row.seq.draft_history == DraftHistory(acceptance=0.0, reviewed_at=0)
    SpeculativeDecoder(NgramDrafter(4), max_model_len=512).review([row])
    assert row.seq.draft_history.reviewed_at == 40  # judged by a shadow window

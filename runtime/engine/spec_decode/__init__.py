"""Speculative decoding: drafters propose tokens, one forward pass of the target verifies them.

A step of a speculative engine, per request with ``k`` speculative tokens (issue 15):

1. a drafter proposes up to ``k`` tokens from the request's tokens so far (:mod:`.drafter`: the
   interface; :mod:`.ngram`: prompt lookup, model-free; :mod:`.draft_model`: a smaller model of
   the same vocabulary);
2. the target model runs ``k + 1`` rows per request (its last token and the drafts), every row
   producing logits (runtime/model/verify_attention.py; a FULL graph of query length ``k + 1``);
3. :mod:`.rejection` keeps the longest acceptable prefix of the drafts and adds one token of the
   target's own, so every step emits between 1 and ``k + 1`` tokens; the emitted tokens follow the
   target's distribution exactly (greedy: identical to non-speculative decoding);
4. :mod:`.acceptance` counts proposed and accepted tokens, per draft position.
"""

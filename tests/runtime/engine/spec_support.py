"""Helpers of the speculative-decoding tests: sampling tensors, a tiny random model, and two
generation loops over a paged KV cache with the real sampler: plain decoding, and speculative
decoding (a drafter, one verification pass of k + 1 rows per request through
``verify_attention``, then ``rejection.verify``)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from graphserving.runtime.engine.sampler import SamplingTensors, sample
from graphserving.runtime.engine.spec_decode.acceptance import AcceptanceStats
from graphserving.runtime.engine.spec_decode.drafter import DraftRequest
from graphserving.runtime.engine.spec_decode.rejection import expand_sampling_tensors, verify
from graphserving.runtime.model.forward_metadata import ForwardMetadata
from graphserving.runtime.model.kv_cache import allocate_kv_cache
from graphserving.runtime.model.kv_layout import NULL_BLOCK
from graphserving.runtime.model.presets import preset_config, random_model
from graphserving.runtime.model.verify_attention import expand_for_verification, verify_attention


def sampling_tensors(rows: int, vocab: int, *, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, rep=1.0,
                     presence=0.0, frequency=0.0, seeds=0, steps=0, prompt=None, output=None, num_logprobs=-1,
                     bias=None) -> SamplingTensors:
    """SamplingTensors of ``rows`` rows; scalars are broadcast, lists taken per row. ``prompt`` /
    ``output``: per-row token lists (padded with ``vocab``); ``bias``: {token: value} for every row."""
    def full(v, dtype=torch.float32):
        return torch.tensor(v, dtype=dtype) if isinstance(v, list) else torch.full((rows,), v, dtype=dtype)

    def padded(lists):
        if lists is None:
            return torch.full((rows, 1), vocab, dtype=torch.int64)
        width = max(1, max(len(x) for x in lists))
        return torch.tensor([x + [vocab] * (width - len(x)) for x in lists], dtype=torch.int64)

    greedy = all(t == 0 for t in (temperature if isinstance(temperature, list) else [temperature]))
    t = SamplingTensors(
        temperature=full(temperature), top_k=full(vocab if top_k is None else top_k, torch.int64), top_p=full(top_p),
        min_p=full(min_p), repetition_penalty=full(rep), presence_penalty=full(presence),
        frequency_penalty=full(frequency), seeds=full(seeds, torch.int64), steps=full(steps, torch.int64),
        prompt_token_ids=padded(prompt), output_token_ids=padded(output), num_logprobs=num_logprobs,
        all_greedy=greedy,
    )
    if bias:
        t.bias_token_ids = torch.tensor([list(bias)] * rows, dtype=torch.int64)
        t.bias_values = torch.tensor([list(bias.values())] * rows, dtype=torch.float32)
    return t


def tiny_model(seed: int = 0, layers: int = 2, hidden: int = 64):
    """A random SmolLM2-shaped model: vocab 300, 256 positions, float32 on the CPU."""
    cfg = dataclasses.replace(preset_config("smollm2-135m"), vocab_size=300, hidden_size=hidden,
                              intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
                              tie_word_embeddings=False)
    return random_model(cfg, torch.float32, "cpu", max_positions=256, seed=seed).eval()


@dataclass
class Request:
    """One sequence being generated; ``params`` are :func:`sampling_tensors` keywords (``bias``:
    the first request's applies to the batch)."""

    prompt: list[int]
    max_tokens: int
    seed: int = 0
    params: dict = field(default_factory=dict)
    output: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class PagedLoop:
    """Generation over one paged KV cache (scrambled blocks), one sequence per request."""

    def __init__(self, model, num_blocks: int = 160, block_size: int = 4, seed: int = 0):
        self.model = model
        self.vocab = model.config.vocab_size
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, torch.float32, "cpu")
        self.free = [b for b in range(num_blocks) if b != NULL_BLOCK]
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def _slot(self, seq: int, pos: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // self.block_size:
            table.append(self.free.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _meta(self, rows: list[tuple[int, list[int], int]]) -> ForwardMetadata:
        """rows: (sequence, input tokens, first position); every row of every sequence gets logits."""
        ids, positions, slots, seq_lens, query_lens = [], [], [], [], []
        for seq, tokens, start in rows:
            for j, token in enumerate(tokens):
                ids.append(token)
                positions.append(start + j)
                slots.append(self._slot(seq, start + j))
            seq_lens.append(start + len(tokens))
            query_lens.append(len(tokens))
        width = max(len(self.tables[seq]) for seq, _, _ in rows)
        tables = [self.tables[seq] + [NULL_BLOCK] * (width - len(self.tables[seq])) for seq, _, _ in rows]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return ForwardMetadata(
            input_ids=torch.tensor(ids), positions=torch.tensor(positions),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_lens=torch.tensor(query_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            block_table=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots), logits_indices=torch.arange(len(ids)),
            num_actual_tokens=len(ids), num_actual_reqs=len(rows), max_query_len=max(query_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
        )

    @torch.inference_mode()
    def forward(self, rows) -> torch.Tensor:
        """The model's own forward pass; float32 logits of every token row."""
        meta = self._meta(rows)
        return self.model.compute_logits(self.model(meta, self.kv_caches))

    @torch.inference_mode()
    def verify_forward(self, rows, query_len: int) -> torch.Tensor:
        """The forward pass with every layer's attention through ``verify_attention``."""
        meta = self._meta(rows)
        model = self.model
        expanded = expand_for_verification(meta.seq_lens, meta.block_table, query_len)
        outs = model.run_segment(0, meta.input_ids, meta.positions, None, None)
        for i in range(model.num_layers):
            q, k, v, residual = outs
            attn = verify_attention(q, k, v, self.kv_caches[i], meta.slot_mapping, expanded, model.scale)
            outs = model.run_segment(i + 1, meta.input_ids, meta.positions, attn, residual)
        return model.compute_logits(outs[0])

    def tensors(self, requests: list[Request]) -> SamplingTensors:
        """One row per request: its parameters, seed, step (= output tokens) and tokens so far."""
        keys = set().union(*(r.params for r in requests)) - {"bias"}
        per_row = {key: [r.params.get(key, _DEFAULTS[key]) for r in requests] for key in keys}
        if "top_k" in per_row:
            per_row["top_k"] = [self.vocab if v is None else v for v in per_row["top_k"]]
        t = sampling_tensors(len(requests), self.vocab, seeds=[r.seed for r in requests],
                             steps=[len(r.output) for r in requests], prompt=[r.prompt for r in requests],
                             output=[r.output for r in requests], bias=requests[0].params.get("bias"), **per_row)
        t.do_penalties = True
        return t

    def prefill(self, requests: list[Request]) -> None:
        """Each prompt through the model; the first output token of each from the plain sampler."""
        for i, r in enumerate(requests):
            logits = self.forward([(i, r.prompt, 0)])[-1:]
            r.output.append(int(sample(logits, self.tensors([r])).token_ids[0]))

    def plain(self, requests: list[Request]) -> list[list[int]]:
        """Non-speculative decoding: one token per request per step."""
        self.prefill(requests)
        while not all(r.done for r in requests):
            live = [(i, r) for i, r in enumerate(requests) if not r.done]
            logits = self.forward([(i, [r.tokens[-1]], len(r.tokens) - 1) for i, r in live])
            tokens = sample(logits, self.tensors([r for _, r in live])).token_ids.tolist()
            for (_, r), token in zip(live, tokens):
                r.output.append(token)
        return [r.output for r in requests]

    def speculative(self, requests: list[Request], drafter, stats: AcceptanceStats | None = None) -> list[list[int]]:
        """Speculative decoding: per step, drafts, one verification pass of k + 1 rows, and the
        emitted tokens (cut at ``max_tokens``)."""
        k = drafter.num_speculative_tokens
        self.prefill(requests)
        while not all(r.done for r in requests):
            live = [(i, r) for i, r in enumerate(requests) if not r.done]
            proposal = drafter.propose(
                [DraftRequest(r.tokens, r.max_tokens - len(r.output) - 1, r.seed, len(r.output)) for _, r in live],
                "cpu")
            drafts = proposal.token_ids.clamp(min=0).tolist()  # padded positions run token 0
            rows = [(i, [r.tokens[-1], *d], len(r.tokens) - 1) for (i, r), d in zip(live, drafts)]
            logits = self.verify_forward(rows, k + 1)
            t_rows = expand_sampling_tensors(self.tensors([r for _, r in live]), proposal.token_ids,
                                             proposal.num_drafts, self.vocab)
            out = verify(logits, t_rows, proposal)
            if stats is not None:
                stats.observe(proposal.num_drafts.tolist(), out.num_accepted.tolist())
            for (_, r), tokens, n in zip(live, out.token_ids.tolist(), out.num_emitted.tolist()):
                r.output += tokens[: min(n, r.max_tokens - len(r.output))]
        return [r.output for r in requests]


_DEFAULTS = dict(temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, rep=1.0, presence=0.0, frequency=0.0)

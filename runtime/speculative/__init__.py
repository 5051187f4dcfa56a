"""Speculative decoding: cheap drafts, one batched verify forward, exact rollback.

One *round* (:meth:`SpeculativeDecoder.step`) after the last emitted token ``x`` at position L:

1. **Draft** up to k tokens ``d1..dk`` from one source:

   * ``grammar``: the span a structured-output grammar forces (free, almost always right);
   * ``mtp``: the model's multi-token-prediction head, run autoregressively (the first draft from
     real main hidden states, the next ones chained through the head's own output);
   * ``lookup``: prompt lookup, the continuation of the latest earlier match of the last 3, 2
     or 1 tokens in prompt + output (no model at all; pays on repetitive text and code).

2. **Verify**: ``model.forward([x, d1..dk], cache)`` through the same kernels as one-token decode
   (batch-invariant: every row is bit-identical to a one-row step, DESIGN.md section 3), so row i
   gives exactly the logits plain decoding would see after ``x, d1..di``.
3. **Accept** the longest prefix the target agrees with, then one more token from the first
   disagreeing row (or the bonus row after k accepts): greedy compares argmaxes, so output is
   byte-identical to plain greedy decoding; sampling uses speculative rejection sampling
   (Leviathan et al. 2023, Chen et al. 2023: accept d with probability min(1, p(d)/q(d)), else
   sample norm(max(0, p - q))), which draws from exactly the target distribution p. Deterministic
   drafts (lookup, grammar, greedy MTP) have a one-hot q.
4. **Roll back**: ``cache.truncate`` drops the rejected rows; the MTP head's cache keeps only rows
   built from real main hidden states (its chained draft rows are truncated and the accepted
   positions re-run from the verify forward's hidden states on the next round).

A :class:`CostModel` fed by live telemetry (acceptance per source and draft position, step time
per row count, draft time, expert misses and stall time of a streaming store, the expert union
a wider step routes to) picks per round the source and k of the best estimated tokens/s, or no
drafts; a source that does not pay is probed again now and then.

Modules: ``policy`` (the ``--draft`` option), ``drafts`` (prompt lookup, the MTP head),
``acceptance`` (rejection sampling), ``cost`` (the cost model), ``stats`` (telemetry),
``decoder`` (the rounds).

Shape legend: V vocab, D hidden, T rows of a step, k drafts (a verify step has k + 1 rows),
P pending MTP rows, K experts per token, E routed experts per layer.
"""

from __future__ import annotations

from runtime.speculative._common import SOURCES, Emitted, Source, TokenConstraint
from runtime.speculative.acceptance import accept_or_resample, expected_tokens, sample_from
from runtime.speculative.cost import CostModel
from runtime.speculative.decoder import SpeculativeDecoder
from runtime.speculative.drafts import MtpDrafter, lookup_draft, lookup_match
from runtime.speculative.policy import DraftPolicy
from runtime.speculative.stats import SpecStats

__all__ = [
    "SOURCES",
    "CostModel",
    "DraftPolicy",
    "Emitted",
    "MtpDrafter",
    "Source",
    "SpecStats",
    "SpeculativeDecoder",
    "TokenConstraint",
    "accept_or_resample",
    "expected_tokens",
    "lookup_draft",
    "lookup_match",
    "sample_from",
]

"""Shared-prefix (tree) training: a group's common prompt is forwarded once, not per row.

The rollouts of one group share their prompt (a framework's system prompt, tool schemas and
the task), often thousands of tokens, and differ only after it. `plan` sorts rows by their
token ids, so rows that share a prefix are neighbours, and cuts them into trees: rows whose
longest common prefix is P tokens, within a micro-batch budget. `tree_logits` forwards a
tree's first S = P - 1 tokens once (one row, with a KV cache), broadcasts that cache over
the branches and forwards each branch (tokens S.. of its row) on top of it, at positions
S.. (RoPE sees the same positions as in the whole row). The branches start one token
before the prefix ends so that the logits predicting token P, the first one that differs,
come from the branch pass.

Exactness: every token sees the same context as in its own row, so its log-prob is the
same; `TreeLogits.per_token` rebuilds each row's [T] log-probs from the prefix's (shared)
and the branch's, so the loss, its denominator, the per-token weights and masks are those
of the plain micro-batch (`TreeBatch.mb` is its collation). The backward pass goes through
the prefix's activations once: the cache's broadcast sums the branches' gradients into
them. A sampled token inside the prefix stays exact too: its log-prob is computed once and
broadcast to every row, each with its own advantage and weight (the usual prefix holds no
sampled token, and its log-probs then carry no loss).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from tracerl.trainer.packing import MicroBatch, pack
from tracerl.types import Transition

__all__ = ["TreeBatch", "TreeLogits", "forwarded_tokens", "plan", "tree_logits"]


class TreeBatch(NamedTuple):
    """Rows forwarded as one tree: their shared prefix once, then the branches."""

    mb: MicroBatch
    """The rows collated as plain rows (right-padded): what the loss reads."""
    shared: int
    """S: leading tokens forwarded once for all rows (0: a plain micro-batch)."""


class TreeLogits(NamedTuple):
    """A tree's logits: the prefix's once and every branch's."""

    prefix_1SV: Tensor
    """Logits of the prefix's S positions (position t predicts token t + 1)."""
    branch_BUV: Tensor
    """Logits of positions S.. of each row, U = T - S (right-padded like the rows)."""

    def per_token(
        self, fn: Callable[[Tensor, Tensor, Tensor], Tensor], ids_BT: Tensor, temp_B: Tensor
    ) -> Tensor:
        """fn (`token_logprobs` or `token_entropy` as (logits, ids, temp)) over every row,
        as [B, T], equal to fn on the rows' whole logits.

        fn's value at t reads the logits at t - 1, so the prefix gives tokens 0..S and the
        branch tokens S+1..; the prefix's values are broadcast over the rows.
        """
        B, T = ids_BT.shape
        S = self.prefix_1SV.shape[1]
        # One extra position, since fn's last position predicts nothing: it yields token S.
        pad_11V = self.prefix_1SV.new_zeros(1, 1, self.prefix_1SV.shape[-1])
        prefix_1P = fn(torch.cat([self.prefix_1SV, pad_11V], 1), ids_BT[:1, : S + 1], temp_B[:1])
        branch_BU = fn(self.branch_BUV, ids_BT[:, S:], temp_B)
        return torch.cat([prefix_1P.expand(B, S + 1), branch_BU[:, 1:]], dim=1)


def tree_logits(model: torch.nn.Module, tb: TreeBatch, bf16: bool) -> TreeLogits:
    """Forward the prefix once, then every branch on the prefix's broadcast KV cache."""
    device = next(model.parameters()).device
    ids_BT = tb.mb.input_ids_BT.to(device)
    B, T = ids_BT.shape
    S = tb.shared
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=ids_BT[:1, :S], use_cache=True)
        cache = _broadcast(out.cache, B)
        # Right padding: the prefix is real in every row, so the rows' own mask is the
        # mask over cache + branch; positions continue from S as in the whole rows.
        pos_BU = torch.arange(S, T, device=device).expand(B, T - S)
        branch = model(
            input_ids=ids_BT[:, S:],
            attention_mask=tb.mb.attention_mask_BT.to(device),
            position_ids=pos_BU,
            cache=cache,
            use_cache=True,
        )
    return TreeLogits(out.logits, branch.logits)


def _broadcast(cache: object, B: int) -> object:
    """The prefix's cache, each layer's keys and values expanded from 1 to B rows.

    `expand` copies nothing; the branch pass concatenates its own keys onto these, and
    autograd sums the B rows' gradients back into the one prefix.
    """
    for layer in cache.layers:  # type: ignore[attr-defined]
        layer.keys = layer.keys.expand(B, -1, -1, -1)
        layer.values = layer.values.expand(B, -1, -1, -1)
    return cache


def forwarded_tokens(tb: TreeBatch) -> int:
    """Tokens a tree forwards, padding excluded: the prefix once, each branch's own."""
    rows = int(tb.mb.attention_mask_BT.sum())
    return rows - tb.shared * (tb.mb.input_ids_BT.shape[0] - 1)


class _Tree(NamedTuple):
    """A tree being planned: row indices (sorted by ids), common prefix, longest row."""

    idx: list[int]
    common: int
    longest: int

    def cost(self) -> int:
        """Padded tokens it forwards: the prefix once, then len(idx) branches."""
        s = max(self.common - 1, 0)
        return s + len(self.idx) * (self.longest - s)


def plan(rows: list[Transition], max_tokens: int) -> list[TreeBatch]:
    """Trees of rows that share a prefix, then the other rows packed plainly (`pack`).

    Rows are sorted by (temperature, ids): the prefix's log-probs are taken at one
    temperature, and neighbours in that order share the longest prefixes. A row joins the
    open tree when the tree still fits max_tokens and forwards fewer tokens with it than
    the tree and the row apart; trees of one row, or of a prefix under 2 tokens, are plain.
    """
    order = sorted(range(len(rows)), key=lambda i: (rows[i].temperature, rows[i].input_ids))
    trees: list[_Tree] = []
    for i in order:
        ids = rows[i].input_ids
        if trees and _same_temperature(rows, trees[-1], i):
            t = trees[-1]
            common = min(t.common, _common(rows[t.idx[-1]].input_ids, ids))
            grown = _Tree([*t.idx, i], common, max(t.longest, len(ids)))
            if grown.cost() <= max_tokens and grown.cost() < t.cost() + len(ids):
                trees[-1] = grown
                continue
        trees.append(_Tree([i], len(ids), len(ids)))
    out, rest = [], []
    for t in trees:
        if len(t.idx) > 1 and t.common >= 2:
            out.append(TreeBatch(_collate(rows, t.idx), t.common - 1))
        else:
            rest += t.idx
    return out + [TreeBatch(mb, 0) for mb in _pack_subset(rows, sorted(rest), max_tokens)]


def _same_temperature(rows: list[Transition], tree: _Tree, i: int) -> bool:
    return rows[tree.idx[0]].temperature == rows[i].temperature


def _common(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def _collate(rows: list[Transition], idx: list[int]) -> MicroBatch:
    """The rows idx as one plain micro-batch (row_indices index `rows`)."""
    (mb,) = _pack_subset(rows, idx, sys.maxsize)
    return mb


def _pack_subset(rows: list[Transition], idx: list[int], max_tokens: int) -> list[MicroBatch]:
    """`pack` of the rows idx, with row_indices mapped back to indices of `rows`."""
    if not idx:
        return []
    batches = pack([rows[i] for i in idx], max_tokens)
    return [mb._replace(row_indices=[idx[j] for j in mb.row_indices]) for mb in batches]

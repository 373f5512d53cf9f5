"""How a batch of ForwardItems is laid out for one padded forward: shared by every runtime.

`plan_batch` turns items into numpy arrays (token ids, RoPE positions, per-item local attention masks, the
cache rows to write and the rows to return logits for), and the attention mask:

`cache_mask(rows)`: keys are the slot's cache rows `0 .. rows-1`, the new tokens at their own rows: the torch
runtime attends over its slots directly; exported graphs get `key_rows(items)` gathered cache rows (or more) and
write the new tokens' keys into them at `new_rows()`.

With a sliding window (Mistral; specdec.families), both masks also hide every key whose RoPE position is
`sliding_window` or more before the query's, as transformers' sliding_window_overlay does: the window
follows positions, not cache rows (tree nodes sit at rows past their depth).

`group_by_width` keeps items of very different widths (a prompt chunk, one-token steps) out of one padded
forward. `split_for_limits` cuts a batch to a graph's shape limits (TensorRT optimization profiles): batches into
smaller batches, long causal inputs into consecutive chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.runtime.base import ForwardItem, ForwardOutput, tree_ancestor_mask, tree_depths


@dataclass
class BatchLayout:
    """A padded batch of `batch` items, `width` new tokens each (padding rows are ignored)."""

    ids: np.ndarray  # [B, W] int64
    positions: np.ndarray  # [B, W] int64 RoPE positions
    past: np.ndarray  # [B] int64 prefix rows every new token of the item sees
    first_row: np.ndarray  # [B] int64 cache row of the item's first new token (past + cached tree nodes)
    num_tokens: np.ndarray  # [B] int64 new tokens of each item
    cached: list[np.ndarray | None]  # per item: [n, m] bool, new node i sees the cached tree node j
    local: np.ndarray  # [B, W, W] bool: new token i attends to new token j (zero on padding)
    total: int  # max(first_row + num_tokens): cache rows the batch touches
    write_slot: np.ndarray  # [R] slot of every valid new row
    write_row: np.ndarray  # [R] its cache row
    write_src: np.ndarray  # [R] its index in the flattened [B * W] new tokens
    logit_rows: np.ndarray  # [N] flattened [B * W] indices whose logits are returned, item after item
    logit_counts: np.ndarray  # [B] num_logits of each item
    hidden_rows: np.ndarray  # [M] flattened [B * W] indices whose hidden states are returned, item after item
    hidden_counts: np.ndarray  # [B] num_hidden of each item
    features: np.ndarray | None  # [B, W, F] fp32 input features of an EAGLE head (zero on padding), else None
    context_positions: list[np.ndarray]  # per item: RoPE positions of its rows 0 .. first_row-1
    sliding_window: int | None = None  # a query sees keys less than this many positions back

    @property
    def batch(self) -> int:
        return int(self.ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    def new_rows(self) -> np.ndarray:
        """[B, W] int64 cache row of every new token (padding tokens: the rows after the item's last one)."""
        return self.first_row[:, None] + np.arange(self.width, dtype=np.int64)[None, :]

    def cache_mask(self, rows: int | None = None) -> np.ndarray:
        """[B, W, rows] bool over cache rows (new rows of item b at `first_row[b] ..`; default rows: total)."""
        rows = self.total if rows is None else rows
        if rows < self.total:
            raise ValueError(f"{rows} key rows are fewer than the {self.total} the batch touches")
        mask = np.zeros((self.batch, self.width, rows), dtype=bool)
        mask[:, :, 0] = True  # padding rows attend somewhere; their outputs are discarded
        for b in range(self.batch):
            n, first = int(self.num_tokens[b]), int(self.first_row[b])
            self._context(mask[b, :n], b)
            mask[b, :n, first : first + n] = self.local[b, :n, :n]
            if self.sliding_window is not None:
                keys = np.zeros(rows, dtype=np.int64)
                keys[:first] = self.context_positions[b]
                keys[first : first + n] = self.positions[b, :n]
                self._window(mask[b, :n], b, keys)
        return mask

    def _window(self, rows: np.ndarray, b: int, key_positions: np.ndarray) -> None:
        """Hide from item b's valid queries the keys `sliding_window` or more positions back."""
        queries = self.positions[b, : rows.shape[0], None]
        rows &= key_positions[None, :] > queries - self.sliding_window

    def _context(self, rows: np.ndarray, b: int) -> None:
        """Set item b's attention to the rows before its first new token (prefix, then cached tree nodes)."""
        past = int(self.past[b])
        rows[:, :past] = True
        if self.cached[b] is not None:
            rows[:, past : int(self.first_row[b])] = self.cached[b]

    def split_logits(self, logits: np.ndarray) -> list[np.ndarray]:
        """Per-item views of logits computed for `logit_rows`."""
        return np.split(logits, np.cumsum(self.logit_counts)[:-1])

    def outputs(self, logits: np.ndarray, hidden_all: np.ndarray | None) -> list[ForwardOutput]:
        """Per-item results from the logits of `logit_rows` and the hidden states of all [B * W] rows."""
        per_item = self.split_logits(logits)
        if hidden_all is None or not len(self.hidden_rows):
            return [ForwardOutput(item_logits) for item_logits in per_item]
        hidden = np.split(hidden_all[self.hidden_rows], np.cumsum(self.hidden_counts)[:-1])
        return [ForwardOutput(item_logits, h if count else None)
                for item_logits, h, count in zip(per_item, hidden, self.hidden_counts, strict=True)]


def plan_batch(items: list[ForwardItem], max_length: int, sliding_window: int | None = None,
               feature_size: int = 0) -> BatchLayout:
    """Lay out `items` for one padded forward; raises ValueError past the cache length or when an EAGLE head's
    item (`feature_size` > 0) lacks a feature per token."""
    batch = len(items)
    width = max(item.num_tokens for item in items)
    total = max(item.end_row for item in items)
    if total > max_length:
        raise ValueError(f"sequence would reach {total} tokens, past the cache length {max_length}")
    ids = np.zeros((batch, width), dtype=np.int64)
    positions = np.zeros((batch, width), dtype=np.int64)
    local = np.zeros((batch, width, width), dtype=bool)
    cached: list[np.ndarray | None] = []
    context_positions: list[np.ndarray] = []
    features = np.zeros((batch, width, feature_size), dtype=np.float32) if feature_size else None
    write_slot, write_row, write_src, logit_rows, hidden_rows = [], [], [], [], []
    for b, item in enumerate(items):
        n, past, first = item.num_tokens, item.past_length, item.first_row
        if not 1 <= item.num_logits <= n:
            raise ValueError(f"num_logits {item.num_logits} outside 1..{n}")
        if not 0 <= item.num_hidden <= n:
            raise ValueError(f"num_hidden {item.num_hidden} outside 0..{n}")
        ids[b, :n] = item.input_ids
        if features is not None:
            if item.features is None or item.features.shape != (n, feature_size):
                got = None if item.features is None else item.features.shape
                raise ValueError(f"an EAGLE head needs features [{n}, {feature_size}] for its input, got {got}")
            features[b, :n] = item.features
        if item.tree_parents is None:
            if item.num_cached_nodes:
                raise ValueError("num_cached_nodes needs tree_parents")
            positions[b, :n] = past + np.arange(n)
            local[b, :n, :n] = np.tril(np.ones((n, n), dtype=bool))
            cached.append(None)
            context_positions.append(np.arange(past, dtype=np.int64))
        else:
            parents = np.asarray(item.tree_parents)
            m = item.num_cached_nodes
            if len(parents) != m + n:
                raise ValueError(f"tree_parents lists {len(parents)} nodes, expected {m} cached + {n} new")
            depths = tree_depths(parents)
            positions[b, :n] = past + depths[m:]
            context_positions.append(np.concatenate([np.arange(past), past + depths[:m]]).astype(np.int64))
            ancestors = tree_ancestor_mask(parents)[m:]
            local[b, :n, :n] = ancestors[:, m:]
            cached.append(ancestors[:, :m] if m else None)
        write_slot.extend([item.slot] * n)
        write_row.extend(range(first, first + n))
        write_src.extend(range(b * width, b * width + n))
        logit_rows.extend(range(b * width + n - item.num_logits, b * width + n))
        hidden_rows.extend(range(b * width + n - item.num_hidden, b * width + n))
    as_i64 = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    return BatchLayout(
        ids=ids, positions=positions, past=as_i64([it.past_length for it in items]),
        first_row=as_i64([it.first_row for it in items]), num_tokens=as_i64([it.num_tokens for it in items]),
        cached=cached, local=local, total=total, write_slot=as_i64(write_slot), write_row=as_i64(write_row),
        write_src=as_i64(write_src), logit_rows=as_i64(logit_rows),
        logit_counts=as_i64([it.num_logits for it in items]), hidden_rows=as_i64(hidden_rows),
        hidden_counts=as_i64([it.num_hidden for it in items]), features=features,
        context_positions=context_positions, sliding_window=sliding_window,
    )


def key_rows(items: list[ForwardItem]) -> int:
    """Cache rows an exported graph reads for `items`: every item's first new row plus the batch's padded width,
    so each item's padding tokens have rows of their own past its valid ones."""
    return max(1, max(item.first_row for item in items) + max(item.num_tokens for item in items))


WIDTH_SLACK = 8  # new tokens an item may be padded by and still share a forward with wider items


def group_by_width(items: list[ForwardItem]) -> list[list[int]]:
    """Indices of `items` in groups that each run as one padded forward, widest first: an item joins the
    group of wider items when padding it to their width costs at most WIDTH_SLACK tokens or doubles it at most.
    A prompt chunk beside one-token decode steps would pad every step to the chunk's width: 14 steps and a
    47-token chunk took 1.0-1.3 s as one forward, 0.15-0.17 s as two (the default target, this CPU)."""
    order = sorted(range(len(items)), key=lambda i: items[i].num_tokens, reverse=True)
    groups: list[list[int]] = []
    for i in order:
        width, own = (items[groups[-1][0]].num_tokens if groups else 0), items[i].num_tokens
        if groups and (width - own <= WIDTH_SLACK or 2 * own >= width):
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(group) for group in groups]


@dataclass
class Piece:
    """Part of one original item, run in some round; `keep` logits (and `keep_hidden` hidden states) of it
    belong to the caller's item."""

    item_index: int
    item: ForwardItem
    keep: int
    keep_hidden: int = 0


def split_for_limits(items: list[ForwardItem], max_batch: int | None, max_tokens: int | None) -> list[list[Piece]]:
    """Cut `items` into sub-batches that run in order: at most `max_batch` items and `max_tokens` new tokens
    each. A causal item longer than `max_tokens` becomes consecutive chunks in consecutive rounds (a chunk
    needs the rows the previous one wrote); a tree must fit whole. Chunks before the last ask for at least
    one logit (graphs return at least one) and keep only the ones the item wanted."""
    rounds: list[list[Piece]] = []
    for index, item in enumerate(items):
        n = item.num_tokens
        if max_tokens is None or n <= max_tokens:
            chunks = [(0, n)]
        elif item.tree_parents is not None:
            raise ValueError(f"a tree of {n} tokens exceeds this runtime's {max_tokens} tokens per step")
        else:
            chunks = [(start, min(start + max_tokens, n)) for start in range(0, n, max_tokens)]
        first_logit, first_hidden = n - item.num_logits, n - item.num_hidden
        for r, (start, end) in enumerate(chunks):
            keep = max(0, end - max(start, first_logit))
            keep_hidden = max(0, end - max(start, first_hidden))
            if len(chunks) == 1:
                piece_item = item
            else:  # causal chunks (trees are never cut)
                piece_item = ForwardItem(slot=item.slot, past_length=item.past_length + start,
                                         input_ids=item.input_ids[start:end], num_logits=max(1, keep),
                                         num_hidden=keep_hidden,
                                         features=None if item.features is None else item.features[start:end])
            while len(rounds) <= r:
                rounds.append([])
            rounds[r].append(Piece(index, piece_item, keep, keep_hidden))
    batches: list[list[Piece]] = []
    for pieces in rounds:
        step = max_batch or len(pieces)
        batches.extend(pieces[i : i + step] for i in range(0, len(pieces), step))
    return batches

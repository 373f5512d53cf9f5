"""KV memory that follows the tokens in use: a pool of fixed-size blocks shared by every sequence (paging).

Each decoder runtime keeps its KV cache as one pool of `num_blocks` blocks of `block_size` rows (the rows of
all layers and KV heads of one token). A sequence (a slot) holds a list of blocks, its block table: logical
row r of the slot lives in physical row `table[r // block_size] * block_size + r % block_size`. The engine
resizes a slot's table to the rows its next step needs before the forward (growing, or giving back the
blocks of rejected draft rows: rows past `past_length` are dead, rollback by length), and frees the table
at END, on cancellation and on the idle timeout. So the memory held is ceil(tokens / block_size) blocks per
live sequence whatever the context window, and 64 short sequences and 2 long ones draw on the same pool.

The pool is allocated (and its pages committed) at load, sized by the deployment's KV budget: a budget that
does not fit fails the load, never the busy hour; past the pool a step fails with CapacityError for that
request alone. The speculative loop's admission (specdec.admission) reserves each generation's worst case
(prompt + max_tokens rows) in blocks before it starts, so a running generation never meets a full pool.
Why blocks rather than per-slot growth: docs/KV_MEMORY.md.

Plain Python and numpy: the runtimes map rows with it (numpy index arrays), no torch needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import CapacityError

DEFAULT_BLOCK_SIZE = 16  # rows per block: small enough that a short sequence wastes little, large enough for few tables
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def blocks_for(rows: int, block_size: int) -> int:
    return -(-rows // block_size)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class PoolModel:
    """What one decoder's pool needs per token: its KV shape and element size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)


def pair_pool_blocks(budget_bytes: int, block_size: int, models: list[PoolModel]) -> int:
    """Blocks each decoder of a pair gets from a budget for the pair: a sequence needs its rows in every
    decoder (target and draft), so each pool holds the same number of blocks and their bytes add up to at
    most `budget_bytes`."""
    per_block = block_size * sum(model.bytes_per_token for model in models)
    blocks = budget_bytes // per_block
    if blocks < 1:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                         f"({per_block} bytes for the pair)")
    return int(blocks)


@dataclass(frozen=True)
class KVPoolConfig:
    """The deployment's KV budget for a target/draft pair, as build/render_configs.py writes it into the
    `kv_pool` parameter of target_model, draft_model and speculative_decoding (JSON: budget_bytes,
    block_size, models: [{dir, dtype}] with dirs relative to the model repository's model folder). All
    three compute the same `num_blocks`: each decoder allocates that many blocks of its own shape, and
    admission reserves them."""

    budget_bytes: int
    block_size: int
    model_dirs: tuple[Path, ...]
    dtypes: tuple[str, ...]

    @classmethod
    def from_json(cls, text: str, models_root: str | Path) -> KVPoolConfig:
        """An `optional` model (the EAGLE head) counts only when its folder holds a checkpoint."""
        data = json.loads(text)
        models = [model for model in data["models"] if not model.get("optional")
                  or (Path(models_root) / model["dir"] / "config.json").is_file()]
        for model in models:
            if model["dtype"] not in DTYPE_BYTES:
                raise ValueError(f"kv_pool: dtype {model['dtype']!r} is not one of {', '.join(DTYPE_BYTES)}")
        return cls(int(data["budget_bytes"]), int(data.get("block_size", DEFAULT_BLOCK_SIZE)),
                   tuple((Path(models_root) / model["dir"]).resolve() for model in models),
                   tuple(model["dtype"] for model in models))

    def pool_models(self) -> list[PoolModel]:
        from specdec.checkpoint import read_spec

        models = []
        for folder, dtype in zip(self.model_dirs, self.dtypes, strict=True):
            spec = read_spec(folder)
            models.append(PoolModel(spec.num_layers, spec.num_kv_heads, spec.head_dim, DTYPE_BYTES[dtype]))
        return models

    def num_blocks(self) -> int:
        return pair_pool_blocks(self.budget_bytes, self.block_size, self.pool_models())

    def served_context(self, requested: int | None) -> int:
        """The context served to a generation: `requested` capped by every model of the pair
        (ModelSpec.served_length) and by the rows the pool holds."""
        from specdec.checkpoint import read_spec

        lengths = [read_spec(folder).served_length(requested) for folder in self.model_dirs]
        return min(*lengths, self.num_blocks() * self.block_size)


class BlockPool:
    """Block tables of `num_slots` slots over a pool of `num_blocks` blocks (bookkeeping only: the runtime
    owns the arrays and indexes them with `physical_rows`)."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low blocks first
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]

    @property
    def num_rows(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    def rows_held(self, slot: int) -> int:
        return len(self.tables[slot]) * self.block_size

    def resize(self, slot: int, rows: int) -> None:
        """Make `slot` hold exactly the blocks `rows` rows need: grow (CapacityError when the pool cannot,
        the slot unchanged) or give the trailing blocks back."""
        table = self.tables[slot]
        wanted = blocks_for(rows, self.block_size)
        if wanted > len(table):
            missing = wanted - len(table)
            if missing > len(self._free):
                raise CapacityError(
                    f"KV memory full: {rows} rows need {missing} more blocks of {self.block_size} tokens, "
                    f"{len(self._free)} of {self.num_blocks} are free")
            table.extend(self._free.pop() for _ in range(missing))
        elif wanted < len(table):
            self._free.extend(reversed(table[wanted:]))
            del table[wanted:]

    def release(self, slot: int) -> None:
        self.resize(slot, 0)

    def physical_rows(self, slot: int, rows: np.ndarray) -> np.ndarray:
        """Physical rows of logical `rows` of `slot` (all must be held)."""
        rows = np.asarray(rows, dtype=np.int64)
        table = np.asarray(self.tables[slot], dtype=np.int64)
        if rows.size and int(rows.max()) >= len(table) * self.block_size:
            raise IndexError(f"slot {slot} holds {len(table) * self.block_size} rows, row {int(rows.max())} asked")
        return table[rows // self.block_size] * self.block_size + rows % self.block_size

    def gather_rows(self, slots: list[int], length: int) -> np.ndarray:
        """[len(slots), length] physical rows of logical rows 0..length-1 of each slot; rows a slot does not
        hold point at row 0 (padding the caller's attention mask hides)."""
        out = np.zeros((len(slots), length), dtype=np.int64)
        offsets = np.arange(self.block_size, dtype=np.int64)
        for b, slot in enumerate(slots):
            table = np.asarray(self.tables[slot], dtype=np.int64)
            held = min(length, len(table) * self.block_size)
            if held:
                out[b, :held] = (table[:, None] * self.block_size + offsets[None, :]).reshape(-1)[:held]
        return out

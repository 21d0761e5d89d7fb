"""The paged KV cache: one preallocated pool of fixed-size blocks, block tables, and multimodal prefix caching.

Lessons: lessons/04-paged-kv-cache.md (paging), lessons/06-prefix-caching.md (content-addressed blocks).

The pool holds `num_blocks` blocks of `block_size` token slots per layer. A sequence owns a *block table*:
the list of block ids that hold its tokens in order, so token i lives in slot
`block_table[i // block_size] * block_size + i % block_size`. Memory is handed out a block at a time, so a
sequence wastes at most block_size - 1 slots, and no sequence is padded to another's length.

Prefix caching: a full block is named by a hash chained over everything that determines its KV: the parent
block's hash, the block's token ids and, for blocks that cover image tokens, the content hash of each
overlapping image with the offset of the image span relative to the block. (Token ids alone are not enough:
all image-pad tokens share one id, so two different pictures would otherwise look identical.) A request whose
leading blocks hash to blocks already in the pool reuses them (reference counts), and skips their compute.
Freed blocks keep their contents and hash until the pool needs them back, evicted least recently used first.
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from nanomm.engine.kv_fp8 import Fp8KVCache


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and its KV computed


def hash_block(parent: bytes | None, token_ids, block_start: int, image_spans) -> bytes:
    """sha256 over (parent hash, token ids, [(image hash, span start - block start)] for overlapping images)."""
    block_end = block_start + len(token_ids)
    extra = [(s.content_hash, s.start - block_start) for s in image_spans if s.overlaps(block_start, block_end)]
    h = hashlib.sha256(parent or b"")
    h.update(repr((tuple(token_ids), extra)).encode())
    return h.digest()  # full 32 bytes: a cache key is never truncated


KV_CACHE_DTYPES = ("auto", "fp8")  # "auto": the model's dtype; "fp8": float8 e4m3 with scales (kv_fp8.py)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device, kv_cache_dtype: str = "auto") -> "torch.Tensor | Fp8KVCache":
    """(layers, 2, num_blocks * block_size, kv_heads, head_dim): k and v of every slot, in one tensor of the
    model's dtype; or, for kv_cache_dtype="fp8", the same slots in an `Fp8KVCache`.

    Slots are only ever read after they are written, so the values do not matter; torch.zeros rather than
    torch.empty commits the memory now. On a CPU the pages of an empty tensor are taken only when first
    written, so a server's memory would creep up for minutes as the free list rotates through the pool (the
    soak in BENCHMARKS.md saw it), and a pool too large for the machine would fail mid-serve, not at start.
    """
    if kv_cache_dtype == "fp8":
        return Fp8KVCache(num_layers, num_blocks * block_size, num_kv_heads, head_dim, dtype, device)
    return torch.zeros(num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


class PlainKVCache:
    """Reads and writes of a model-dtype pool tensor (layers, 2, slots, kv_heads, head_dim), the same three calls
    `Fp8KVCache` answers, so attention (attention.py) does not care which it has."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.tensor[layer, 0].index_copy_(0, slots, k)
        self.tensor[layer, 1].index_copy_(0, slots, v)

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensor[layer, 0].index_select(0, slots), self.tensor[layer, 1].index_select(0, slots)

    def read_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows of this layer's pool viewed as (2 * slots * kv_heads, head_dim)."""
        return self.tensor[layer].view(-1, self.tensor.shape[-1]).index_select(0, rows)


class BlockManager:
    """Hands out blocks, counts references, and keeps the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody references, in the order they are handed out: blocks holding nothing findable first,
        # then cached blocks oldest-freed first (the eviction order). Cached blocks stay here, findable by
        # hash, until they are handed out again.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.hit_tokens = self.queried_tokens = 0  # prefix-cache counters

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ------------------------------------------------------------------------------------

    def block_hashes(self, token_ids, image_spans, num_full_blocks: int, known: list[bytes]) -> list[bytes]:
        """Extend `known` (the hashes of the first blocks) to the first num_full_blocks blocks of token_ids."""
        hashes = list(known)
        if not self.enable_prefix_caching:
            return hashes  # nothing will look them up: skip the sha256 work
        for b in range(len(hashes), num_full_blocks):
            start = b * self.block_size
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, token_ids[start:start + self.block_size], start, image_spans))
        return hashes

    def count_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Record one request's first lookup (a preempted request's second lookup is not counted again)."""
        self.queried_tokens += num_queried_tokens
        self.hit_tokens += num_hit_tokens

    def find_cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """Block ids of the longest run of leading blocks already in the pool."""
        found = []
        for h in hashes:
            block_id = self.cached.get(h) if self.enable_prefix_caching else None
            if block_id is None:
                break
            found.append(block_id)
        return found

    def register(self, block_table: list[int], hashes: list[bytes], num_computed_tokens: int) -> None:
        """Name every block that is full and computed by its hash, so later requests can find it."""
        if not self.enable_prefix_caching:
            return
        for b in range(num_computed_tokens // self.block_size):
            block = self.blocks[block_table[b]]
            if block.block_hash is None and hashes[b] not in self.cached:
                block.block_hash = hashes[b]
                self.cached[hashes[b]] = block.block_id

    # -- allocation --------------------------------------------------------------------------------------

    def can_allocate(self, num_new_blocks: int, reused: list[int] = ()) -> bool:
        """Enough free blocks for num_new_blocks new ones, after taking the reused cached blocks off the list."""
        reused_from_free = sum(1 for b in reused if self.blocks[b].ref_count == 0)
        return num_new_blocks <= self.num_free_blocks - reused_from_free

    def take_cached(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        assert n <= self.num_free_blocks, "caller must check can_allocate first"
        out = []
        for _ in range(n):
            block_id, _ = self.free_blocks.popitem(last=False)  # an empty block, else the least recently freed
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict: its contents are about to be overwritten
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            out.append(block_id)
        return out

    def grow_to(self, block_table: list[int], num_tokens: int) -> bool:
        """Append blocks to a block table until it holds num_tokens; False, and nothing taken, if the pool
        lacks them."""
        needed = self.blocks_needed(num_tokens) - len(block_table)
        if not self.can_allocate(needed):
            return False
        block_table += self.allocate(needed)
        return True

    def shrink_to(self, block_table: list[int], num_tokens: int) -> None:
        """Free the blocks of a block table past those num_tokens need (speculative rollback)."""
        keep = self.blocks_needed(num_tokens)
        self.free(block_table[keep:])
        del block_table[keep:]

    def free(self, block_table: list[int]) -> None:
        # Tail blocks first: they are the least likely to be shared, so they should be evicted first.
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.block_hash is None:  # nothing in it anyone can find: hand it out before evicting one
                    self.free_blocks.move_to_end(block_id, last=False)

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_blocks - self.num_free_blocks,
            "kv_blocks_cached": len(self.cached),
            "prefix_cache_queried_tokens": self.queried_tokens,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
        }

    def check_no_leaks(self) -> None:
        """Every block is free again (for tests and for the end of LLM.generate)."""
        held = [b.block_id for b in self.blocks if b.ref_count]
        assert not held and self.num_free_blocks == self.num_blocks, f"blocks still referenced: {held[:10]}"

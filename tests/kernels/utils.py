"""Shared helpers for the kernel tests: error metric and MLA decode cases."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (never passes)."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm()).item()


@dataclass
class MLACase:
    q: torch.Tensor  # [T, H, L + R]
    kv_cache: torch.Tensor  # [N, block_size, L + R]; NaN outside the requests' keys
    block_tables: torch.Tensor  # [B, max_blocks]; padding points at an all-NaN block
    seq_lens: torch.Tensor  # [B]
    query_start_loc: torch.Tensor  # [B + 1]
    kv_lora_rank: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.kv_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                self.kv_lora_rank, self.scale)  # fmt: skip

    def clean_args(self, dtype: torch.dtype = torch.float64) -> tuple:
        """The same inputs upcast, NaN poison zeroed (the reference reads whole pages)."""
        a = list(self.args())
        a[0] = self.q.to(dtype)
        a[1] = self.kv_cache.to(dtype).nan_to_num(0.0)
        return tuple(a)


def make_mla_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    lat: int,
    rope: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    extra_table_cols: int = 2,
) -> MLACase:
    """Random queries and cache; pages in shuffled order; every slot a request does not
    own (tails past seq_len, unused blocks, table padding) holds NaN, so any read of
    one shows up in the output."""
    d = lat + rope
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 2  # block 0 stays all-NaN: the table's padding points there
    kv = torch.full((num_blocks, block_size, d), float("nan"))
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(pages) + extra_table_cols, dtype=torch.int64)
    used = 0
    for i, (s, n) in enumerate(zip(seq_lens, pages)):
        blocks = perm[used : used + n]
        used += n
        table[i, :n] = torch.tensor(blocks)
        flat = torch.randn(n * block_size, d, generator=gen)
        flat[s:] = float("nan")
        kv[blocks] = flat.view(n, block_size, d)
    t = sum(q_lens)
    q = torch.randn(t, num_heads, d, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64)
    return MLACase(
        q=q.to(dtype=dtype, device=device),
        kv_cache=kv.to(dtype=dtype, device=device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        query_start_loc=qsl.to(device),
        kv_lora_rank=lat,
        scale=d**-0.5,
    )

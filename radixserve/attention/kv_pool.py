"""The KV page pool: the storage behind the page ids the scheduler hands out."""

from __future__ import annotations

import torch


class KVPool:
    """Per layer, K and V of shape [num_pages + 1, page_size, num_kv_heads, head_dim] (FlashInfer's NHD).

    A token at position `pos` of a request lives in page `pages[pos // page_size]` at offset
    `pos % page_size`; its flat slot is `page * page_size + offset`.

    Pages 0 .. num_pages - 1 are the scheduler's to hand out. One more page, `pad_page`
    (= num_pages), is never handed out: the padding entries of a CUDA-graph decode batch write
    their K/V there, so padding never touches a request's data.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.pad_page = num_pages
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one page costs across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    def flat_k(self, layer_id: int) -> torch.Tensor:
        """K of one layer as [(num_pages + 1) * page_size, Hkv, D], indexed by flat slot."""
        return self.k[layer_id].view(-1, self.num_kv_heads, self.head_dim)

    def flat_v(self, layer_id: int) -> torch.Tensor:
        """V of one layer as [(num_pages + 1) * page_size, Hkv, D], indexed by flat slot."""
        return self.v[layer_id].view(-1, self.num_kv_heads, self.head_dim)

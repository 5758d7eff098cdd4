"""The KV page pool: the storage behind the page ids the scheduler hands out."""

from __future__ import annotations

import torch

from radixserve.kernels import kv_quant
from radixserve.kernels.kv_quant import SCALE_DTYPE, KVFormat, dequantize, quantize


def raw(t: torch.Tensor) -> torch.Tensor:
    """`t` as torch can index-copy it: fp8 tensors viewed as their bytes (torch's CPU
    index_copy_ has no fp8 kernels); others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class KVPool:
    """Per layer, K and V of shape [num_pages + 1, page_size, num_kv_heads, head_dim] (FlashInfer's NHD).

    A token at position `pos` of a request lives in page `pages[pos // page_size]` at offset
    `pos % page_size`; its flat slot is `page * page_size + offset`.

    Pages 0 .. num_pages - 1 are the scheduler's to hand out. One more page, `pad_page`
    (= num_pages), is never handed out: the padding entries of a CUDA-graph decode batch write
    their K/V there, so padding never touches a request's data.

    `dtype` is the model's: what new K/V come in as and what `read` gives back. `format`
    (`--kv-cache-dtype`, kernels/kv_quant.py) is what the pages store: the model's dtype by
    default, or 8 bits an element, quantized once by `store`. int8 pages have a scale per token
    and KV head beside them (`k_scales`, `v_scales`: [num_pages + 1, page_size, num_kv_heads]
    fp16 per layer), and a page is its data and its scales together (`page_tensors`).
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
        kv_format: KVFormat | None = None,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.format = kv_format or kv_quant.kv_format("auto", dtype)
        self.device = torch.device(device)
        self.pad_page = num_pages
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        storage = self.format.storage
        self.k = [torch.zeros(shape, dtype=storage, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=storage, device=self.device) for _ in range(num_layers)]
        scales = shape[:-1] if self.format.scaled else (0,)
        self.k_scales = [torch.zeros(scales, dtype=SCALE_DTYPE, device=self.device) for _ in range(num_layers)]
        self.v_scales = [torch.zeros(scales, dtype=SCALE_DTYPE, device=self.device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, kv_format: KVFormat) -> int:
        """Bytes one page costs across all layers, K and V, scales included."""
        return 2 * num_layers * page_size * num_kv_heads * kv_format.bytes_per_token_head(head_dim)

    @property
    def quantized(self) -> bool:
        return self.format.quantized

    @property
    def converted(self) -> bool:
        """Whether the pages store something other than the model's dtype (8 bits, or fp32 KV
        under a bf16 model): stored through `quantize`, read through `dequantize`."""
        return self.format.storage != self.dtype

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by page, in a page's byte order: K and V of layer 0, of layer 1,
        ..., then (int8) their scales in the same order. What moving a page moves."""
        data = [t for pair in zip(self.k, self.v, strict=True) for t in pair]
        if not self.format.scaled:
            return data
        return data + [t for pair in zip(self.k_scales, self.v_scales, strict=True) for t in pair]

    def flat_k(self, layer_id: int) -> torch.Tensor:
        """K of one layer as [(num_pages + 1) * page_size, Hkv, D], indexed by flat slot."""
        return self.k[layer_id].view(-1, self.num_kv_heads, self.head_dim)

    def flat_v(self, layer_id: int) -> torch.Tensor:
        """V of one layer as [(num_pages + 1) * page_size, Hkv, D], indexed by flat slot."""
        return self.v[layer_id].view(-1, self.num_kv_heads, self.head_dim)

    def flat_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """int8: K's and V's scales of one layer as [(num_pages + 1) * page_size, Hkv]; else Nones."""
        if not self.format.scaled:
            return None, None
        return self.k_scales[layer_id].view(-1, self.num_kv_heads), self.v_scales[layer_id].view(-1, self.num_kv_heads)

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K and V ([T, Hkv, D], the model's dtype) at `slots` ([T]),
        quantized once if the format is."""
        if not self.converted:
            self.flat_k(layer_id).index_copy_(0, slots, k)
            self.flat_v(layer_id).index_copy_(0, slots, v)
            return
        k_scales, v_scales = self.flat_scales(layer_id)
        for pool, scales, x in ((self.flat_k(layer_id), k_scales, k), (self.flat_v(layer_id), v_scales, v)):
            data, scale = quantize(x, self.format)
            raw(pool).index_copy_(0, slots, raw(data))
            if scales is not None:
                scales.index_copy_(0, slots, scale)

    def read(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` ([S, Hkv, D] each), as `dtype` (the model's by default):
        dequantized copies where the format is quantized."""
        dtype = dtype or self.dtype
        k = self.flat_k(layer_id).index_select(0, slots)
        v = self.flat_v(layer_id).index_select(0, slots)
        if not self.converted:
            return k.to(dtype), v.to(dtype)
        k_scales, v_scales = self.flat_scales(layer_id)
        ks = None if k_scales is None else k_scales.index_select(0, slots)
        vs = None if v_scales is None else v_scales.index_select(0, slots)
        return dequantize(k, ks, self.format, dtype), dequantize(v, vs, self.format, dtype)

"""Where each KV block lives in memory, and transfer descriptors for a set of blocks.

A layer's KV cache is one tensor. Its *regions* are the parts indexed by block id:
on CPU (`[num_blocks, kv_heads, block_size, 2*head_size]`) one region per layer, K and V
together; in the usual GPU layout (`[2, num_blocks, ...]`) two regions, K then V. Block
`b` of a region starts at `base + b * stride` and is `block_bytes` long, so blocks move
as opaque bytes, never per token.

`merge_descriptors` turns (remote, local) block pairs into as few (addr, len) pairs as
possible: consecutive blocks that are contiguous on both sides become one descriptor, and
so do whole regions that lie back to back (CPU layers are slices of one buffer). One
transfer per request, not one per layer-block.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class Region(msgspec.Struct, frozen=True):
    base: int
    stride: int
    block_bytes: int


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The memory layout of one engine's KV cache (per layer, per region)."""

    num_blocks: int
    block_size: int
    layers: list[list[Region]]
    device: str  # "DRAM" or "VRAM"
    device_id: int = 0
    layout_name: str = "unknown"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across all layers and regions."""
        return sum(r.block_bytes for layer in self.layers for r in layer)

    def spans(self) -> list[tuple[int, int]]:
        """(addr, length) of every region, for memory registration (merged when adjacent)."""
        raw = sorted((r.base, r.stride * (self.num_blocks - 1) + r.block_bytes)
                     for layer in self.layers for r in layer)
        merged: list[tuple[int, int]] = []
        for addr, length in raw:
            if merged and merged[-1][0] + merged[-1][1] >= addr:
                start, ln = merged[-1]
                merged[-1] = (start, max(ln, addr + length - start))
            else:
                merged.append((addr, length))
        return merged


def shape_signature(layout: KVLayout) -> tuple:
    """What must match between two engines for blocks to be copied as bytes."""
    return (layout.num_layers, tuple(len(layer) for layer in layout.layers),
            tuple(r.block_bytes for layer in layout.layers for r in layer), layout.block_size)


def merge_descriptors(remote: KVLayout, local: KVLayout, remote_ids: Sequence[int],
                      local_ids: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Descriptor lists (addr, len) for reading `remote_ids` into `local_ids`, merged.

    Returns (local_descs, remote_descs) of equal length; descriptor i of one side has the
    same length as descriptor i of the other.
    """
    if len(remote_ids) != len(local_ids):
        raise ValueError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local blocks")
    if shape_signature(remote) != shape_signature(local):
        raise ValueError("layouts differ; blocks cannot be copied as bytes")
    loc: list[tuple[int, int]] = []
    rem: list[tuple[int, int]] = []
    for lreg_layer, rreg_layer in zip(local.layers, remote.layers):
        for lr, rr in zip(lreg_layer, rreg_layer):
            n = lr.block_bytes
            for lid, rid in zip(local_ids, remote_ids):
                la, ra = lr.base + lid * lr.stride, rr.base + rid * rr.stride
                if loc and loc[-1][0] + loc[-1][1] == la and rem[-1][0] + rem[-1][1] == ra:
                    loc[-1] = (loc[-1][0], loc[-1][1] + n)
                    rem[-1] = (rem[-1][0], rem[-1][1] + n)
                else:
                    loc.append((la, n))
                    rem.append((ra, n))
    return loc, rem


def layout_from_tensors(kv_caches: dict, num_blocks: int, block_size: int) -> KVLayout:
    """Describe vLLM's registered KV caches ({layer_name: tensor}) in layer order."""
    layers: list[list[Region]] = []
    device = "DRAM"
    device_id = 0
    name = "unknown"
    for tensor in kv_caches.values():
        if isinstance(tensor, (list, tuple)):
            tensors = list(tensor)
        else:
            tensors = [tensor]
        regions: list[Region] = []
        for t in tensors:
            esize = t.element_size()
            if t.shape[0] == num_blocks:
                name = "block-major"
                regions.append(Region(t.data_ptr(), t.stride(0) * esize, t[0].numel() * esize))
            elif t.shape[0] == 2 and t.shape[1] == num_blocks:
                name = "kv-major"
                for half in (t[0], t[1]):
                    regions.append(Region(half.data_ptr(), half.stride(0) * esize, half[0].numel() * esize))
            else:
                raise ValueError(f"unsupported KV cache shape {tuple(t.shape)} for {num_blocks} blocks")
            if t.is_cuda:
                device, device_id = "VRAM", t.device.index or 0
        layers.append(regions)
    return KVLayout(num_blocks=num_blocks, block_size=block_size, layers=layers, device=device,
                    device_id=device_id, layout_name=name)

"""KV layout and descriptor merging: pure, hand-checkable cases."""

import pytest

from kvtransfer.layout import KVLayout, Region, merge_descriptors

BB = 100  # block bytes


def cpu_layout(base: int, layers: int = 3, num_blocks: int = 10, gap: int = 0) -> KVLayout:
    # CPU style: one region per layer; layers back to back in one buffer (gap=0).
    stride = BB
    layer_len = num_blocks * stride + gap
    return KVLayout(num_blocks=num_blocks, block_size=128, device="DRAM",
                    layers=[[Region(base + i * layer_len, stride, BB)] for i in range(layers)])


def test_consecutive_blocks_merge_within_a_layer():
    r, l = cpu_layout(10_000, layers=1), cpu_layout(50_000, layers=1)
    local, remote = merge_descriptors(r, l, [2, 3, 4], [5, 6, 7])
    assert local == [(50_000 + 5 * BB, 3 * BB)]
    assert remote == [(10_000 + 2 * BB, 3 * BB)]


def test_non_consecutive_blocks_split():
    r, l = cpu_layout(0, layers=1), cpu_layout(100_000, layers=1)
    local, remote = merge_descriptors(r, l, [1, 2, 7], [0, 1, 2])
    assert remote == [(1 * BB, 2 * BB), (7 * BB, BB)]
    assert local == [(100_000, 2 * BB), (100_000 + 2 * BB, BB)]
    assert [n for _, n in local] == [n for _, n in remote]


def test_whole_buffer_read_is_one_descriptor_when_layers_are_adjacent():
    r, l = cpu_layout(0, layers=3, num_blocks=4), cpu_layout(10**6, layers=3, num_blocks=4)
    ids = [0, 1, 2, 3]
    local, remote = merge_descriptors(r, l, ids, ids)
    assert remote == [(0, 3 * 4 * BB)] and local == [(10**6, 3 * 4 * BB)]


def test_layers_with_gaps_give_one_descriptor_per_layer():
    r, l = cpu_layout(0, layers=3, gap=7), cpu_layout(10**6, layers=3, gap=7)
    local, remote = merge_descriptors(r, l, [4, 5], [1, 2])
    assert len(local) == len(remote) == 3
    assert sum(n for _, n in remote) == 3 * 2 * BB  # bytes = layers x blocks x block bytes


def test_kv_major_layout_has_two_regions_per_layer():
    def gpu(base):
        return KVLayout(num_blocks=8, block_size=16, device="VRAM",
                        layers=[[Region(base, BB, BB), Region(base + 10_000, BB, BB)]])
    local, remote = merge_descriptors(gpu(0), gpu(50_000), [3], [6])
    assert remote == [(3 * BB, BB), (10_000 + 3 * BB, BB)]
    assert local == [(50_000 + 6 * BB, BB), (60_000 + 6 * BB, BB)]


def test_mismatches_are_refused():
    with pytest.raises(ValueError):
        merge_descriptors(cpu_layout(0), cpu_layout(0), [1, 2], [1])
    with pytest.raises(ValueError):
        merge_descriptors(cpu_layout(0, layers=2), cpu_layout(0, layers=3), [1], [1])


def test_spans_merge_adjacent_layers():
    assert cpu_layout(0, layers=3, num_blocks=4).spans() == [(0, 1200)]
    assert len(cpu_layout(0, layers=3, num_blocks=4, gap=1).spans()) == 3
    assert cpu_layout(0, layers=2, num_blocks=4).bytes_per_block == 2 * BB

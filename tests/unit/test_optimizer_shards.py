"""megatron-core's cut of a gradient buffer over the distributed optimizer's ranks (h3t_training/loop/
optimizer_shards.py), against layouts worked out by hand from megatron-core 0.16.1's param_and_grad_buffer.py."""
import pytest

from h3t_training.loop.optimizer_shards import OwnedSlice, bucket_size, buffer_layout, owned_slices


def test_one_bucket_reverse_order_aligned_starts_padded_end():
    # parameters 0..2 of 100, 10, 90 elements: laid out 2, 1, 0 -> [0, 90), [128, 138), [192, 292); end padded
    # to lcm(2, 128) = 128 -> 384
    spans, buckets = buffer_layout([100, 10, 90], 2, None)
    assert spans == [(192, 292), (128, 138), (0, 90)] and buckets == [(0, 384)]
    assert buffer_layout([100, 10, 90], 3, None)[1] == [(0, 384)]  # lcm(3, 128) = 384
    assert buffer_layout([100, 10, 90], 256, None)[1] == [(0, 512)]


def test_slices_cross_parameter_boundaries():
    got = owned_slices([[100, 10, 90]], 2, [None])
    # rank 0 owns [0, 192): all of parameter 2 and parameter 1; rank 1 [192, 384): parameter 0
    assert got == [OwnedSlice(0, 1, 0, 100), OwnedSlice(1, 0, 0, 10), OwnedSlice(2, 0, 0, 90)]
    got = owned_slices([[300, 20]], 2, [None])  # 1 [0, 20), 0 [64, 364), padded to 384: ranks split at 192
    assert got == [OwnedSlice(0, 0, 0, 128), OwnedSlice(0, 1, 128, 300), OwnedSlice(1, 0, 0, 20)]
    assert sum(s.numel for s in got) == 320


def test_buckets_close_at_the_bucket_size_and_around_a_shared_embedding():
    spans, buckets = buffer_layout([50, 50, 50], 2, 100)
    # 2 [0, 50), 1 [64, 114): 114 >= 100 closes the bucket at 128; 0 [128, 178), the rest padded to 256
    assert spans == [(128, 178), (64, 114), (0, 50)] and buckets == [(0, 128), (128, 256)]
    spans, buckets = buffer_layout([40, 30, 20], 2, None, shared=[True, False, False])
    # the shared embedding (parameter 0, laid out last) starts a bucket of its own after [0, 20), [64, 94)
    assert spans[0] == (128, 168) and buckets == [(0, 128), (128, 256)]
    slices = owned_slices([[40, 30, 20]], 2, [None], [[True, False, False]])
    assert [s for s in slices if s.param == 0] == [OwnedSlice(0, 0, 0, 40)]  # 128 + [0, 64) is rank 0's


def test_several_chunks_number_parameters_across_them():
    got = owned_slices([[10], [10]], 2, [None, None])
    assert got == [OwnedSlice(0, 0, 0, 10), OwnedSlice(1, 0, 0, 10)]  # each chunk's 128-element buffer: rank 0


@pytest.mark.parametrize("kwargs, expected", [
    (dict(ddp_bucket_size=None, overlap_grad_reduce=True, pipeline_rank=0, chunk=0), 40_000_000),
    (dict(ddp_bucket_size=None, overlap_grad_reduce=True, pipeline_rank=0, chunk=0, dp=64), 64_000_000),
    (dict(ddp_bucket_size=1000, overlap_grad_reduce=True, pipeline_rank=0, chunk=0), 1000),
    (dict(ddp_bucket_size=1000, overlap_grad_reduce=False, pipeline_rank=0, chunk=0), None),
    (dict(ddp_bucket_size=1000, overlap_grad_reduce=True, pipeline_rank=1, chunk=0), None),
    (dict(ddp_bucket_size=1000, overlap_grad_reduce=True, pipeline_rank=0, chunk=1), None),
])
def test_bucket_size_as_megatron_core_sets_it(kwargs, expected):
    dp = kwargs.pop("dp", 8)
    assert bucket_size(dp, **kwargs) == expected

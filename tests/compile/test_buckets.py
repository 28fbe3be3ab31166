from kiln.compile.buckets import Bucket, BucketPlan, default_decode_sizes, default_token_sizes
from kiln.config import EngineConfig


def test_default_decode_sizes() -> None:
    assert default_decode_sizes(128) == [1, 2, 4, 8, *range(16, 129, 8)]
    assert default_decode_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_decode_sizes(8) == [1, 2, 4, 8]
    assert default_decode_sizes(1) == [1]


def test_default_token_sizes() -> None:
    assert default_token_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert default_token_sizes(100) == [16, 32, 64, 100]
    assert default_token_sizes(10) == [10]


def test_smallest_bucket_that_holds_the_step() -> None:
    config = EngineConfig.from_options(max_num_seqs=32, max_num_batched_tokens=256, decode_sizes=[1, 4, 32])
    plan = BucketPlan.from_config(config)
    assert plan.decode_sizes == (1, 4, 32)
    assert plan.bucket(3, decode_only=True) == Bucket("decode", 4)
    assert plan.bucket(33, decode_only=True) is None
    assert plan.bucket(17, decode_only=False) == Bucket("tokens", 32)
    assert plan.bucket(257, decode_only=False) is None
    assert [str(b) for b in plan.all()][:3] == ["decode-32", "decode-4", "decode-1"]

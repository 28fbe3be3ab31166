import pytest

from kiln.compile.buckets import Bucket, BucketPlan, default_decode_sizes, default_token_sizes
from kiln.config import EngineConfig, SchedulerConfig


def test_default_decode_sizes() -> None:
    assert default_decode_sizes(128) == [1, 2, 4, 8, *range(16, 129, 8)]
    assert default_decode_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_decode_sizes(8) == [1, 2, 4, 8]
    assert default_decode_sizes(1) == [1]
    # vLLM's CUDA-graph sizes past 256: steps of 16, none above 512 unless compile.max_decode_size says.
    assert default_decode_sizes(512) == [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
    many = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}
    assert BucketPlan.from_config(EngineConfig.from_options(**many)).decode_sizes[-1] == 512
    more = EngineConfig.from_options(**many, max_decode_size=1024)
    assert BucketPlan.from_config(more).decode_sizes[-3:] == (992, 1008, 1024)
    fewer = EngineConfig.from_options(**many, max_decode_size=100)
    assert BucketPlan.from_config(fewer).decode_sizes[-2:] == (96, 100)
    assert default_decode_sizes(300) == [1, 2, 4, *range(8, 257, 8), 272, 288, 300]


def test_scheduler_defaults_are_vllms_for_the_device() -> None:
    default, gib = SchedulerConfig(), 2**30
    limits = {
        "cpu": default.on("cpu"),
        "H100": default.on("cuda", 80 * gib, "NVIDIA H100 80GB HBM3"),
        "A100": default.on("cuda", 80 * gib, "NVIDIA A100-SXM4-80GB"),
        "L4": default.on("cuda", 23 * gib, "NVIDIA L4"),
    }
    got = {k: (c.max_num_seqs, c.max_num_batched_tokens) for k, c in limits.items()}
    assert got == {"cpu": (128, 2048), "H100": (1024, 8192), "A100": (256, 2048), "L4": (256, 2048)}
    mine = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096)
    assert mine.on("cuda", 80 * gib, "NVIDIA H100") == mine


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


def test_buckets_fit_the_steps_the_scheduler_makes() -> None:
    """A decode step holds at most max_num_seqs sequences, and max_num_batched_tokens of them (one token
    each): the default graphs stop there, and an explicit size past either limit is a config error."""
    few_tokens = EngineConfig.from_options(max_num_seqs=1024, max_num_batched_tokens=256)
    assert BucketPlan.from_config(few_tokens).decode_sizes[-1] == 256
    for options, says in [
        ({"max_num_seqs": 16, "decode_sizes": [8, 32]}, r"compile.decode_sizes \[32\] exceed .*, 16"),
        (
            {"max_num_batched_tokens": 64, "decode_sizes": [128]},
            r"compile.decode_sizes \[128\] exceed .*, 64",
        ),
        ({"max_num_batched_tokens": 64, "token_sizes": [32, 128]}, r"compile.token_sizes \[128\] exceed"),
        (  # vLLM's --max-cudagraph-capture-size beside --cudagraph-capture-sizes
            {"decode_sizes": [1, 8, 16], "max_decode_size": 32},
            r"compile.max_decode_size \(32\) should be the largest of compile.decode_sizes \(16\)",
        ),
    ]:
        config = EngineConfig.from_options(**{"max_num_seqs": 256, "max_num_batched_tokens": 2048, **options})
        with pytest.raises(ValueError, match=says):
            BucketPlan.from_config(config)

"""Weight loading: sharded folders, dtypes, and a clear error for each kind of bad checkpoint."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import LLM, SamplingParams
from kiln.models.loader import WeightError, load_config, load_model, resolve_dtype
from kiln.models.registry import ARCHITECTURES, UnsupportedArchitecture
from kiln.models.staging import Stager, data_offsets
from kiln.ops.backend import Backend
from kiln.ops.cpu import native
from kiln.ops.linear import Linear
from kiln.ops.matmul import BLOCK
from kiln.platform import native_matmul_dtypes
from tests.models.tiny import build


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    build("llama", tmp_path)
    return tmp_path


def _edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_all_shards(tmp_path: Path) -> None:
    hf = build("mixtral", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    one, sharded = load_model(tmp_path / "one", "float32"), load_model(tmp_path / "sharded", "float32")
    for (name, a), (_, b) in zip(one.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral", "qwen3_moe", "gpt2"])
def test_weights_staged_in_chunks_equal_direct_copies(
    tmp_path: Path, arch: str, dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The GPU's staged path (pread into a ring of buffers, then a copy) run on the CPU. Chunks of 1001
    bytes (250 float32 elements) split every tensor, and the ring of 3 buffers wraps many times. Served in
    bfloat16, each chunk of the float32 checkpoint converts on its way through the landing buffers. GPT-2's
    transposed weights go the plain way."""
    build(arch, tmp_path)
    direct = load_model(tmp_path, dtype)
    stager = Stager(torch.device("cpu"), chunk=1001, buffers=3, threads=2)
    staged = load_model(tmp_path, dtype, stager=stager)
    assert list(stager.files) == [tmp_path / "model.safetensors"]  # the staged path ran, converting too
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # and did not fall back
    _assert_same_weights(direct, staged)


def test_a_failing_stager_falls_back_to_direct_copies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    build("llama", tmp_path)
    stager = Stager(torch.device("cpu"), chunk=1001, buffers=3, threads=2)
    stager.pool.shutdown()  # its first read then raises RuntimeError, as a failing pinned copy would
    staged = load_model(tmp_path, "float32", stager=stager)
    assert "staged weight loading failed (RuntimeError" in caplog.text
    _assert_same_weights(load_model(tmp_path, "float32"), staged)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_data_offsets_point_at_each_tensor(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(5, dtype=torch.int32), "b": torch.ones(3, 2, dtype=torch.bfloat16)}
    file = tmp_path / "x.safetensors"
    save_file(tensors, file, metadata={"format": "pt"})
    raw = file.read_bytes()
    for name, offset in data_offsets(file).items():
        t = tensors[name]
        assert (
            raw[offset : offset + t.numel() * t.element_size()]
            == t.view(-1).view(torch.uint8).numpy().tobytes()
        )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtype(llama: Path, dtype: str) -> None:
    """The torch references widen weights the CPU has no GEMM for once at load; kiln's CPU kernels keep
    every weight, the LM head's included, in its own dtype, packed."""
    want = getattr(torch, dtype)
    model = load_model(llama, dtype)
    widened = want if want in native_matmul_dtypes(torch.device("cpu")) else torch.float32
    linear = {m.weight.dtype for m in model.layers.modules() if isinstance(m, Linear)}
    assert model.embed.weight.dtype == want and linear == {widened}
    assert model.logits_weight is not None and model.logits_weight.dtype == torch.float32
    cpu = Backend("cpu", "cpu", "torch").layer_kernels(torch.device("cpu"), want)
    packed = load_model(llama, dtype, kernels=cpu)
    assert {p.dtype for p in packed.layers.parameters() if p.dim() > 1} == {want}
    head = packed.logits_weight
    assert head is not None and head.dtype == want
    pairs = want == torch.bfloat16 and native.bf16_dot()  # AVX512-BF16: pairs of k side by side
    assert head.shape[-2:] == ((BLOCK, 2) if pairs else (head.shape[-2], BLOCK))


def test_auto_dtype_for_float32_checkpoints(llama: Path) -> None:
    """vLLM's rule: 16 bits; on a CPU, bfloat16 where it multiplies bfloat16 natively, else float16."""
    config = load_config(llama)
    config.dtype = config.torch_dtype = "float32"
    cpu = torch.device("cpu")
    native_bf16 = torch.bfloat16 in native_matmul_dtypes(cpu)
    assert resolve_dtype("auto", config, cpu) == (torch.bfloat16 if native_bf16 else torch.float16)
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.float16
    assert resolve_dtype("float32", config, cpu) == torch.float32


def test_auto_dtype_follows_config(llama: Path) -> None:
    config = json.loads((llama / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (llama / "config.json").write_text(json.dumps(config))
    assert load_model(llama, "auto").embed.weight.dtype == torch.bfloat16


def test_unknown_architecture_lists_supported(llama: Path) -> None:
    config = json.loads((llama / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match="FooForCausalLM") as e:
        load_model(llama)
    assert all(name in str(e.value) for name in ARCHITECTURES)


def test_missing_tensor_is_named(llama: Path) -> None:
    _edit_weights(llama, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(llama)


def test_unexpected_tensor_is_named(llama: Path) -> None:
    _edit_weights(llama, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(2)}))
    with pytest.raises(WeightError, match=r"unexpected tensor.*model\.layers\.0\.mystery\.weight"):
        load_model(llama)


def test_wrong_shape_is_named(llama: Path) -> None:
    _edit_weights(llama, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(WeightError, match=r"model\.norm\.weight: shape \(3,\)"):
        load_model(llama)


def test_corrupt_safetensors_is_named(llama: Path) -> None:
    file = llama / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(WeightError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(llama)


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(tmp_path)


def test_cudagraph_mode_on_a_cpu_says_it_needs_cuda(llama: Path) -> None:
    with pytest.raises(
        ValueError, match="compile mode 'cudagraph' needs a CUDA device; use 'compiled' or 'eager'"
    ):
        LLM(str(llama), mode="cudagraph")


def test_dummy_weights_need_no_checkpoint(llama: Path) -> None:
    """vLLM's --load-format dummy: nothing read (here nothing is there), every weight drawn from +-1e-3,
    and the model serves."""
    (llama / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing safetensors"):
        load_model(llama)
    values = torch.cat([p.flatten() for p in load_model(llama, "float32", dummy=True).parameters()])
    assert values.abs().max() <= 1e-3 and values.std() > 1e-4
    llm = LLM(str(llama), load_format="dummy", mode="eager", dtype="float32", kv_cache_gib=0.01)
    out = llm.generate(["hi"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_hf_overrides_lay_over_config_json(llama: Path) -> None:
    """vLLM's --hf-overrides: the model is built from config.json with the overrides' keys replaced."""
    plain = load_model(llama, "float32")
    wider = load_model(llama, "float32", hf_overrides={"max_position_embeddings": 96, "rms_norm_eps": 0.5})
    assert (
        (wider.dims.max_positions, wider.dims.norm_eps)
        == (96, 0.5)
        != (
            plain.dims.max_positions,
            plain.dims.norm_eps,
        )
    )
    llm = LLM(str(llama), hf_overrides={"max_position_embeddings": 96}, mode="eager", kv_cache_gib=0.01)
    assert llm.engine.max_model_len == 96

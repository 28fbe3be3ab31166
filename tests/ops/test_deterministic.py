"""backend.deterministic's wiring, without a GPU: the config key and flag, the backend choice (refusing the
torch references it can't make batch-invariant), and the Triton GEMM in a model run by the interpreter."""

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.cli import _load_config, build_parser
from kiln.config import EngineConfig
from kiln.ops import backend as backend_module
from kiln.ops.backend import Backend, choose_backend
from kiln.ops.matmul import CpuMatmul
from kiln.ops.triton.matmul import TritonMatmul
from tests.models.test_architectures import PROMPTS
from tests.models.tiny import build

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # only the device's type is read


def test_the_config_key_and_the_flag_set_it() -> None:
    assert EngineConfig().backend.deterministic is False
    assert EngineConfig.from_options(deterministic=True).backend.deterministic is True
    assert _load_config(build_parser().parse_args(["serve", "--deterministic"])).backend.deterministic
    assert not _load_config(build_parser().parse_args(["serve"])).backend.deterministic


def test_a_cpu_with_kiln_kernels_is_accepted() -> None:
    choice = choose_backend("auto", "auto", "auto", CPU, 64, torch.bfloat16, deterministic=True)
    assert choice == Backend("cpu", "cpu", "torch", deterministic=True)
    assert isinstance(choice.layer_kernels(CPU, torch.bfloat16).matmul, CpuMatmul)
    assert not choose_backend("cpu", "cpu", "auto", CPU, 64, torch.bfloat16).deterministic


@pytest.mark.parametrize(("kernels", "attention"), [("torch", "torch"), ("torch", "cpu"), ("cpu", "torch")])
def test_a_cpu_forced_to_torch_refuses_it(kernels: str, attention: str) -> None:
    with pytest.raises(ValueError, match=r"backend\.deterministic needs kiln's CPU kernels"):
        choose_backend(kernels, attention, "auto", CPU, 64, torch.bfloat16, deterministic=True)
    choose_backend(kernels, attention, "auto", CPU, 64, torch.bfloat16)  # fine when not asked


def test_cuda_takes_the_triton_gemm_and_needs_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module, "_importable", lambda name: True)  # as on a GPU machine
    choice = choose_backend("auto", "auto", "auto", CUDA, 128, torch.bfloat16, deterministic=True)
    assert choice == Backend("triton", "flashinfer", "flashinfer", deterministic=True)
    kernels = choice.layer_kernels(CUDA, torch.bfloat16)
    assert kernels.name == "triton" and isinstance(kernels.matmul, TritonMatmul)
    assert kernels.moe_experts.keywords == {"deterministic": True}  # one row tile for every step
    plain = choose_backend("auto", "auto", "auto", CUDA, 128, torch.bfloat16)
    assert not isinstance(plain.layer_kernels(CUDA, torch.bfloat16).matmul, TritonMatmul)
    # auto's fallback to torch's attention for a head dim FlashInfer lacks can't be batch-invariant.
    with pytest.raises(ValueError, match=r"backend\.deterministic needs .* FlashInfer .*head_dim 32"):
        choose_backend("auto", "auto", "auto", CUDA, 32, torch.bfloat16, deterministic=True)
    monkeypatch.setattr(backend_module, "_importable", lambda name: name != "flashinfer")
    with pytest.raises(ValueError, match=r"backend\.deterministic .*FlashInfer is not installed"):
        choose_backend("auto", "auto", "auto", CUDA, 128, torch.bfloat16, deterministic=True)


@pytest.mark.parametrize(("arch", "mode"), [("llama", "eager"), ("qwen3_moe", "compiled")])
def test_tiny_models_on_the_triton_gemm_answer_alone_as_in_a_batch(
    arch: str, mode: str, tmp_path: Path
) -> None:
    """The interpreter runs the deterministic kernels in the model (kiln's CPU attention around them);
    compiled, torch.compile traces the model around them, the deterministic MoE's call included."""
    build(arch, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = {"dtype": "float32", "kv_cache_gib": 0.01, "device": "cpu"}
    llm = LLM(str(tmp_path), kernels="triton", attention="cpu", deterministic=True, mode=mode, **options)
    assert type(llm.engine.model.kernels.matmul).__name__ == "TritonMatmul"
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert alone == together
    ref = LLM(str(tmp_path), kernels="torch", attention="torch", mode="eager", **options)
    assert [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)] == together

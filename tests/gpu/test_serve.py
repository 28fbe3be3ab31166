"""A real `kiln serve` on the GPU answers the OpenAI SDK: chat, completions, streaming."""

from pathlib import Path

from openai import OpenAI

from tests.api.server import start_server
from tests.models.tiny import build


def test_kiln_serve_on_the_gpu_answers_the_openai_sdk(tmp_path: Path) -> None:
    build("qwen3", tmp_path / "model", 128)
    config = {
        "model": {"model": str(tmp_path / "model"), "device": "auto", "max_model_len": 256},
        # Sized from free memory (no kv_cache_gib); a small share keeps a tiny model's block count sane.
        "cache": {"gpu_memory_utilization": 0.1},
        "scheduler": {"max_num_seqs": 8},
    }
    server = start_server(tmp_path, config)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt="t1 t2 t3", max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(
                model=model, prompt="t1 t2 t3", max_tokens=8, temperature=0, stream=True
            )
        )
        assert streamed == reply.choices[0].text  # greedy: the stream says what the reply said
        sampled = client.completions.create(
            model=model, prompt="t5", max_tokens=8, n=3, seed=7, extra_body={"top_k": 20, "min_p": 0.05}
        )
        assert len(sampled.choices) == 3
        log = server.output()
        print(
            "\n".join(
                line
                for line in log.splitlines()
                if any(w in line for w in ("ready", "GPU", "CUDA", "bucket"))
            )
        )
        assert "attention flashinfer" in log and "GPU memory: device" in log and "CUDA graphs:" in log
        # The start-up breakdown a CPU start logs, in the ready line (other lines name kernels and weights).
        ready = next(line for line in log.splitlines() if "kiln is ready at" in line)
        for part in ("imports", "kernels", "weights", "compile", "CUDA graph capture", "KV cache"):
            assert f"{part} " in ready, part
    finally:
        assert server.stop() == 0, server.output()

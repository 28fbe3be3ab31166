import socket
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.config_file import ConfigError, load_serve_config
from kiln.server_config import ServeConfig

CONFIGS = Path(__file__).parent.parent / "configs"


def test_default_yaml_is_the_builtin_default() -> None:
    assert load_serve_config(CONFIGS / "default.yaml", {}) == ServeConfig()


@pytest.mark.parametrize("name", ["llama3-8b-h100.yaml", "mixtral.yaml"])
def test_example_configs_parse(name: str) -> None:
    config = load_serve_config(CONFIGS / name, {})
    assert config.model.device == "cuda"
    config.check_supported()


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  max_num_seqs: 4\nserver:\n  port: 9000\n")
    config = load_serve_config(path, {"scheduler": {"max_num_seqs": 8}, "compile": {"mode": "eager"}})
    assert (config.scheduler.max_num_seqs, config.server.port, config.compile.mode) == (8, 9000, "eager")


@pytest.mark.parametrize(
    "text, message",
    [
        ("scheduler:\n  max_num_seq: 8\n", "unknown key 'scheduler.max_num_seq'"),
        ("sever:\n  port: 1\n", "unknown key 'sever'"),
        ("cache:\n  block_size: big\n", "key 'cache.block_size': Expected `int | null`, got `str`"),
        ("server:\n  port: 70000\n", "key 'server.port': Expected `int` <= 65535"),
        ("model: [1]\n", "key 'model': Expected `object`, got `array`"),
        (
            "scheduler:\n  long_prefill_token_threshold: -1\n",
            "key 'scheduler.long_prefill_token_threshold': Expected `int` >= 0",
        ),
        (
            "backend:\n  cpu_threads_bind: all\n",
            "key 'backend.cpu_threads_bind': Expected `str` matching regex",
        ),
        ("- 1\n", "expected a mapping of sections, got list"),
        ("model: {\n", "not valid YAML"),
        ("cache:\n  kv_cache_dtype: int8\n", "key 'cache.kv_cache_dtype': Invalid enum value 'int8'"),
    ],
)
def test_bad_file_names_key_and_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_serve_config(path, {})
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file nope\.yaml"):
        load_serve_config(Path("nope.yaml"), {})


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor-parallel-size", "2"], "tensor_parallel_size > 1 is not supported yet"),
        (["--gpu-memory-utilization", "1.5"], "key 'cache.gpu_memory_utilization': Expected `float` <= 1"),
        (["--max-num-seqs", "0"], "key 'scheduler.max_num_seqs': Expected `int` >= 1"),
        (["--model", "/no/such/folder"], "model folder '/no/such/folder' does not exist"),
        (
            ["--cpu-threads-bind", "0,99999"],
            "backend.cpu_threads_bind '0,99999': CPU 99999 is not one of this",
        ),
        (["--enable-auto-tool-choice"], "server.enable_auto_tool_choice needs server.tool_call_parser"),
        (["--tool-call-parser", "nope"], "invalid choice: 'nope'"),
        (["--kv-cache-dtype", "fp8_inc"], "argument --kv-cache-dtype: invalid choice: 'fp8_inc'"),
        (["--uds", "/no/such/dir/kiln.sock"], "cannot listen on unix:/no/such/dir/kiln.sock: No such file"),
        (
            ["--chat-template", "no/such/template.jinja"],
            "model.chat_template: 'no/such/template.jinja' is neither",
        ),
        (["--lora-modules", "sql"], "argument --lora-modules: 'sql' is not name=path or a JSON object"),
        (
            ["--lora-modules", "sql=/adapters/sql"],
            "server.lora_modules needs lora.enable_lora (--enable-lora)",
        ),
        (
            ["--lora-modules", '{"name": "sql"}'],
            "key 'server.lora_modules[0]': Object missing required field `path`",
        ),
        (
            ["--enable-lora", "--max-lora-rank", "12"],
            "argument --max-lora-rank: invalid choice: 12 (choose from 1, 8, 16",
        ),
        (
            ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"],
            "max_cpu_loras (1) must be >= max_loras (2)",
        ),
    ],
)
def test_serve_refuses_before_binding(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", *flags]) != 0
    assert message in capsys.readouterr().err


def test_serve_port_in_use_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "Traceback" not in err


def test_sampling_defaults_come_from_the_generation_config(tmp_path: Path) -> None:
    """As vLLM reads them: the generation config's sampling fields (not do_sample), with the override laid
    over them; max_new_tokens is max_tokens."""
    import json

    from kiln.config import EngineConfig
    from kiln.engine.tokenizer import sampling_defaults

    config = {
        "temperature": 0.6,
        "top_p": 0.9,
        "repetition_penalty": 1.0,
        "max_new_tokens": 7,
        "do_sample": True,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert sampling_defaults(EngineConfig.from_options(str(tmp_path)), tmp_path) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "max_tokens": 7,
    }
    assert (
        sampling_defaults(EngineConfig.from_options(str(tmp_path), generation_config="vllm"), tmp_path) == {}
    )
    override = EngineConfig.from_options(str(tmp_path), override_generation_config={"temperature": 0.2})
    assert sampling_defaults(override, tmp_path)["temperature"] == 0.2
    elsewhere = EngineConfig.from_options(str(tmp_path), generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"^model.generation_config: no generation_config.json"):
        sampling_defaults(elsewhere, tmp_path)
    assert sampling_defaults(EngineConfig.from_options(str(tmp_path)), tmp_path / "missing") == {}


def test_unset_request_fields_take_the_model_defaults() -> None:
    import msgspec

    from kiln.api.protocol import ChatCompletionRequest
    from kiln.api.serving import sampling_params

    defaults = {"temperature": 0.6, "top_k": 20, "presence_penalty": 0.5, "max_tokens": 7}

    def params(**fields: object) -> object:
        body = msgspec.convert(
            {"messages": [{"role": "user", "content": "Hi"}], **fields}, ChatCompletionRequest
        )
        return sampling_params(body, 10, 100, body.max_tokens, None, defaults=defaults)

    p = params()
    assert (p.temperature, p.top_k, p.presence_penalty, p.max_tokens, p.top_p) == (0.6, 20, 0.5, 7, 1.0)
    p = params(temperature=0.0, presence_penalty=0.0, max_tokens=3)
    assert (p.temperature, p.presence_penalty, p.max_tokens) == (0.0, 0.0, 3)
    assert sampling_params(msgspec.convert({"messages": []}, ChatCompletionRequest), 98, 100, None, None,
                           defaults=defaults).max_tokens == 2  # fmt: skip


def test_vllm_server_flags_parse_as_vllm_writes_them() -> None:
    from kiln.cli import _load_config, build_parser

    args = build_parser().parse_args(
        ["serve", "--api-key", "a", "b", "--allowed-origins", '["https://ui.example"]',
         "--disable-access-log-for-endpoints", "/health,/metrics", "--scheduling-policy", "priority",
         "--stream-interval", "4", "--generation-config", "vllm", "--override-generation-config",
         '{"temperature": 0.5}', "--enable-request-id-headers", "--enable-prompt-tokens-details"]
    )  # fmt: skip
    config = _load_config(args)
    s = config.server
    assert (s.api_keys, s.allowed_origins, s.disable_access_log_for_endpoints) == (
        ["a", "b"],
        ["https://ui.example"],
        ["/health", "/metrics"],
    )
    assert (config.scheduler.policy, s.stream_interval, config.model.generation_config) == (
        "priority",
        4,
        "vllm",
    )
    assert config.model.override_generation_config == {"temperature": 0.5}
    assert s.enable_request_id_headers and s.enable_prompt_tokens_details


def test_vllm_capacity_and_sizing_flags() -> None:
    """vLLM's sizes read as it reads them (1k is 1000, 1K is 1024), each into the key it sets."""
    from kiln.cli import _load_config, build_parser

    args = build_parser().parse_args(
        ["serve", "--max-num-queued-reqs", "8", "--max-num-queued-tokens", "25.6k",
         "--max-num-batched-tokens", "4K", "--kv-cache-memory-bytes", "512M",
         "--num-gpu-blocks-override", "40", "--shutdown-timeout", "0", "--cudagraph-capture-sizes", "1", "2",
         "8", "--max-cudagraph-capture-size", "8", "--root-path", "/kiln", "--uvicorn-log-level", "warning",
         "--sse-keep-alive-interval", "15", "--no-enable-chunked-prefill", "--logprobs-mode",
         "processed_logits", "--anthropic-disabled-thinking-effort", "none", "--structured-outputs-config",
         '{"enable_in_reasoning": true, "disable_any_whitespace": true}']
    )  # fmt: skip
    config = _load_config(args)
    sched, cache, s = config.scheduler, config.cache, config.server
    assert (sched.max_num_queued_reqs, sched.max_num_queued_tokens) == (8, 25600)
    assert sched.max_num_batched_tokens == 4096 and not sched.enable_chunked_prefill
    assert (cache.kv_cache_gib, cache.num_gpu_blocks_override, s.drain_timeout) == (0.5, 40, 0)
    assert (config.compile.decode_sizes, config.compile.max_decode_size) == ([1, 2, 8], 8)
    assert (s.root_path, s.uvicorn_log_level, s.sse_keep_alive_interval) == ("/kiln", "warning", 15)
    assert s.anthropic_disabled_thinking_effort == "none"
    assert config.model.logprobs_mode == "processed_logits"
    so = config.model.structured_outputs_config
    assert so.enable_in_reasoning and so.disable_any_whitespace and so.backend == "auto"


def test_speculative_config_flag() -> None:
    from kiln.cli import _load_config, build_parser

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    config = _load_config(build_parser().parse_args(["serve", "--speculative-config", spec]))
    sc = config.scheduler.speculative_config
    assert sc is not None
    assert (sc.method, sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max) == (
        "ngram",
        3,
        4,
        4,
    )
    assert not config.scheduler.use_async("cuda")  # drafts are looked up in landed tokens


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-num-queued-tokens", "1.5K"], "Decimals are not allowed with binary suffixes like K"),
        (["--kv-cache-memory-bytes", "4GB"], "'4GB' is not a size"),
        (["--root-path", "kiln"], "server.root_path must start with /"),
        (["--sse-keep-alive-interval", "-1"], "key 'server.sse_keep_alive_interval': Expected `int` >= 0"),
        (["--pipeline-parallel-size", "2"], "pipeline_parallel_size > 1 is not supported yet"),
        (["-tp", "2"], "tensor_parallel_size > 1 is not supported yet"),  # vLLM's short forms
        (
            ["--kv-cache-gib", "1", "--kv-cache-memory-bytes", "2G"],
            "--kv-cache-gib and --kv-cache-memory-bytes both set cache.kv_cache_gib: give one",
        ),
        (["/no/such/folder"], "model folder '/no/such/folder' does not exist"),  # vllm serve MODEL
        (["--data-parallel-size", "4"], "data_parallel_size > 1 is not supported yet"),
        (["--middleware", "no.such.Thing"], "--middleware 'no.such.Thing': cannot import it"),
        (
            ["--structured-outputs-config", '{"backend": "guidance"}'],
            "key 'model.structured_outputs_config.backend': Invalid enum value 'guidance'",
        ),
        (["--middleware", "kiln.version.VERSION"], "not an import path to a class or an async function"),
        (
            ["-sc", '{"method": "eagle3", "model": "yuhuili/EAGLE3", "num_speculative_tokens": 3}'],
            "key 'scheduler.speculative_config': speculative method 'eagle3' is not built: kiln drafts by "
            'prompt lookup only ({"method": "ngram"})',
        ),
        (
            ["--speculative-config", '{"method": "ngram"}'],
            "key 'scheduler.speculative_config': num_speculative_tokens is needed with the ngram method",
        ),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}'],
            "unknown key 'scheduler.speculative_config.draft_model'",
        ),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
                "--async-scheduling",
            ],
            "async_scheduling with speculative_config is not supported",
        ),
    ],
)
def test_vllm_flag_values_refused(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", *flags]) != 0
    assert message in capsys.readouterr().err


def test_the_model_may_come_first_as_in_vllm_serve() -> None:
    """`vllm serve MODEL [options]`: the positional model wins over --model, as vLLM's model_tag does."""
    from kiln.cli import _load_config, build_parser

    for argv, model in [
        (["serve", "/models/a", "-tp", "1", "-pp", "1", "-dp", "1"], "/models/a"),
        (["serve", "/models/a", "--model", "/models/b"], "/models/a"),
        (["serve", "--model", "/models/b"], "/models/b"),
    ]:
        assert _load_config(build_parser().parse_args(argv)).model.model == model

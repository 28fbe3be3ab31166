"""The CUDA backend's benchmark on one GPU, by phase (each fits in a 10-minute run; several phases in
one invocation share the random model folders):

- copy: device-to-device copy bandwidth, the roofline batch-1 decode is a fraction of;
- batch1: batch-1 decode on a Llama-3-8B-shaped model (random bf16 weights): tokens/s, and the bandwidth
  it achieves, (weight bytes + KV bytes read per step) x steps/s, as a fraction of copy's; then the decode
  graph's replays under the torch profiler: how many kernels a step runs, and the longest;
- throughput: nano-vllm's workload (256 sequences, input and output lengths uniform in [100, 1024],
  ignore_eos) on a Qwen3-0.6B-shaped model; then the workload again step by step, with its first 8
  (chunked prefill) steps and 50 steps of a nearly full decode batch under the torch profiler: the GPU's
  busy share of their wall time, and the kernels that fill it;
- startup: `kiln serve` on the Llama-3-8B shape, time to ready cold (an empty KILN_CACHE_DIR) and warm
  (the cache the cold start left), each with its first request's TTFT; then a warm `kiln warmup` under
  cProfile (OUT.warmup.prof, and its top functions in OUT.warmup.txt);
- each phase but copy also runs transformers (static cache + torch.compile) in the same run, unless
  --skip-hf names it (or names no phase: all of them);
- --deterministic runs kiln's side in its batch-invariant mode (backend.deterministic), so its cost shows
  against a default run;
- --kernels torch runs batch1's and throughput's kiln with torch's reference ops around attention, which
  Inductor fuses with their neighbours, against Triton's opaque kernels (auto).

    python perf/gpu_bench.py --out results.json --phases copy batch1 throughput startup
        [--skip-hf [PHASE ...]]  # kiln only, in the phases named (all where none is)
        [--models DIR]  # keep the random models, so a run of another kiln tree measures the same ones
        [--deterministic] [--no-async-scheduling] [--kernels {auto,triton,torch}]
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import logging
import os
import platform
import pstats
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.profiler import ProfilerActivity, profile

from kiln import LLM, SamplingParams
from kiln.engine.engine import LLMEngine

log = logging.getLogger("gpu_bench")

PHASES = ("copy", "batch1", "throughput", "startup")
# Engine options every kiln run takes (main sets them from the flags).
KILN_OPTIONS: dict[str, bool | str] = {}

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
    tie_word_embeddings=False,
)  # fmt: skip
QWEN3_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
    rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip


def copy_bandwidth(gib: float = 2.0, iters: int = 20) -> float:
    """Bytes moved per second by a device-to-device copy (read + write)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * iters / (start.elapsed_time(end) / 1e3)


def random_model(config_cls: str, dims: dict, path: Path, device: str = "cuda") -> None:
    """A seeded random bf16 model, saved as safetensors (with a word-level tokenizer over its whole
    vocabulary) so kiln loads exactly the weights transformers runs; kept if the folder has one."""
    if (path / "config.json").is_file():
        return
    config = getattr(transformers, config_cls)(**dims, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)  # norm weights
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(dims["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    del model
    free_gpu()


def hf_model(path: Path, meta: bool = False) -> torch.nn.Module:
    """transformers' model of the folder on the GPU; meta: its shapes alone (no weights read), for sizes."""
    if meta:
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")


def step_bytes(model: torch.nn.Module, context: float) -> float:
    """What one batch-1 decode step must read: every weight but the input embedding table (one row of
    it), plus the KV cache of the context."""
    c = model.config
    weights = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n
    )
    if c.tie_word_embeddings:
        weights += model.get_input_embeddings().weight.numel() * 2
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2
    return weights + kv_per_token * context


def gpu_ms(fn: Callable[[], object], iters: int = 50) -> float:
    """GPU time of one call, by CUDA events around many back-to-back calls (host gaps hidden)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kiln_batch1(path: Path, prompt_len: int, new_tokens: int, result: dict) -> float:
    """Decode tokens/s after the first token, through the engine's step loop; then the GPU time of the
    decode graph's replay and of the logits alone, so the step's host share shows."""
    llm = LLM(str(path), dtype="bfloat16", device="cuda", kv_cache_gib=4, max_model_len=4096, max_num_seqs=8,
              **KILN_OPTIONS)  # fmt: skip
    engine = llm.engine
    log.info("kiln start-up (s): %s", {k: round(v, 2) for k, v in engine.timings.items()})
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 10000) for _ in range(prompt_len)]
    for attempt in range(2):  # the first pass warms every path the second one times
        engine.add_request(f"b1-{attempt}", prompt, params)
        engine.step()  # prefill and the first token
        torch.cuda.synchronize()
        clock = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - clock
    graph = engine.runner.lowering.graphs.captured[1]
    with torch.inference_mode():
        result["batch1_kiln_replay_ms"] = gpu_ms(graph.graph.replay)
        result["batch1_kiln_logits_ms"] = gpu_ms(lambda: engine.model.compute_logits(graph.output[:1]))
        result["batch1_kiln_graph_kernels"] = device_kernels(graph.graph.replay, 20)
    result["batch1_kiln_step_ms"] = seconds / (new_tokens - 1) * 1e3
    log.info(
        "kiln batch-1 step %.2f ms: decode graph %.2f ms, logits %.2f ms on the GPU",
        *(result[f"batch1_kiln_{k}_ms"] for k in ("step", "replay", "logits")),
    )
    log_kernels("kiln's batch-1 decode graph, replayed", result["batch1_kiln_graph_kernels"])
    return (new_tokens - 1) / seconds


def hf_batch1(model: torch.nn.Module, prompt_len: int, new_tokens: int) -> float:
    # A static cache makes generate compile the forward itself (transformers' auto-compile, CUDA graphs).
    model.generation_config.cache_implementation = "static"
    ids = torch.randint(100, 10000, (1, prompt_len), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        clock = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - clock

    run(new_tokens), run(1)  # compile both shapes
    return (new_tokens - 1) / (run(new_tokens) - run(1))


def workload(n: int = 256, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 10000) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
        for _ in range(n)
    ]


def kiln_throughput(path: Path, work: list[tuple[list[int], int]], result: dict) -> float:
    llm = LLM(str(path), dtype="bfloat16", device="cuda", kv_cache_gib=40, max_model_len=2048,
              max_num_seqs=256, max_num_batched_tokens=16384, **KILN_OPTIONS)  # fmt: skip
    log.info("kiln start-up (s): %s", {k: round(v, 2) for k, v in llm.engine.timings.items()})
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    llm.generate([p for p, _ in work[:8]], params[:8], use_tqdm=False)  # warm
    torch.cuda.synchronize()
    clock = time.perf_counter()
    out = llm.generate([p for p, _ in work], params, use_tqdm=True)
    seconds = time.perf_counter() - clock
    step_breakdown(llm.engine, work, params, result)
    return sum(len(o.outputs[0].token_ids) for o in out) / seconds


def device_kernels(run: Callable[[], object], calls: int) -> dict:
    """`run` called `calls` times under the torch profiler, per call: wall ms, the GPU's busy ms (its
    kernels' and copies' time), how many it ran, and the 15 longest by total time. A graph replay's kernels
    are counted one by one (CUPTI reports each node)."""
    torch.cuda.synchronize()  # an asynchronously scheduled step still running would count as busy
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        clock = time.perf_counter()
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - clock
    device = sorted(
        (e for e in prof.key_averages() if e.self_device_time_total > 0),
        key=lambda e: e.self_device_time_total,
        reverse=True,
    )
    return {
        "wall_ms": wall / calls * 1e3,
        "busy_ms": sum(e.self_device_time_total for e in device) / calls / 1e3,
        "kernels": sum(e.count for e in device) / calls,
        "kernels_ms": {e.key: e.self_device_time_total / calls / 1e3 for e in device[:15]},
    }


def log_kernels(what: str, k: dict) -> None:
    log.info(
        "%s: %.2f ms a call, the GPU busy %.2f ms of it in %.0f kernels and copies; the longest:\n%s",
        what, k["wall_ms"], k["busy_ms"], k["kernels"],
        "\n".join(f"  {ms:8.3f} ms  {name}" for name, ms in k["kernels_ms"].items()),
    )  # fmt: skip


def step_breakdown(
    engine: LLMEngine, work: list[tuple[list[int], int]], params: list[SamplingParams], result: dict
) -> None:
    """The workload again, step by step, under the torch profiler: its first 8 steps (chunked prefill, each
    max_num_batched_tokens), then, after 100 steps (every prompt prefilled, no request finished), 50 decode
    steps (a few requests finish in them). What their wall time has beyond the GPU's busy time is where the
    GPU waited for the host (in the prefills, FlashInfer's FA3 plan copies from pageable memory, which the
    driver may stage by synchronizing the stream); the kernels by total time say what a step's GPU time is
    spent on."""
    ids = [f"breakdown-{i}" for i in range(len(work))]
    for rid, (prompt, _), p in zip(ids, work, params, strict=True):
        engine.add_request(rid, prompt, p)
    k = result["prefill_breakdown"] = device_kernels(lambda: engine.step(final_only=True), 8)
    log_kernels("kiln's first 8 steps (chunked prefill)", k)
    for _ in range(100 - 8):
        engine.step(final_only=True)
    batch = len(engine.scheduler.running)
    k = result["throughput_breakdown"] = {
        "batch": batch, **device_kernels(lambda: engine.step(final_only=True), 50)
    }  # fmt: skip
    log_kernels(f"kiln decode steps at batch {batch}", k)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step(final_only=True)


def hf_throughput(model: torch.nn.Module, work: list[tuple[list[int], int]], batch: int = 64) -> float:
    """Batches of 64, left-padded to 1024 prompt tokens and run to 1024 new ones (fixed shapes, so the
    compiled static-cache graphs are reused); only each request's own output length counts."""
    model.generation_config.cache_implementation = "static"
    wanted = sum(o for _, o in work)
    torch.cuda.synchronize()
    clock = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        ids = torch.zeros(len(chunk), 1024, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):
            ids[row, -len(p) :] = torch.tensor(p)
            mask[row, -len(p) :] = 1
        model.generate(ids, attention_mask=mask, max_new_tokens=1024, min_new_tokens=1024, do_sample=False,
                       pad_token_id=0)  # fmt: skip
    torch.cuda.synchronize()
    return wanted / (time.perf_counter() - clock)


def serve_start(path: Path, cache_dir: Path, log_path: Path) -> dict[str, float]:
    """`kiln serve` in a fresh process: seconds until /health answers 200, then one streamed request's
    time to first token, then SIGTERM."""
    env = {**os.environ, "KILN_CACHE_DIR": str(cache_dir)}
    cache_dir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kiln",
        "serve",
        "--model",
        str(path.resolve()),
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        *engine_flags(),
    ]
    clock = time.perf_counter()
    with log_path.open("ab") as out:
        # Not from the repository root: there `-m kiln` imports the checkout's kiln before PYTHONPATH's,
        # and an A/B run's other tree (gpu_check.sh's AB) would not be the one that starts.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cache_dir)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - clock
        body = {
            "model": str(path.resolve()),
            "prompt": list(range(100, 228)),
            "max_tokens": 16,
            "stream": True,
        }
        clock = time.perf_counter()
        ttft = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"the first request got {reply.status_code}: {reply.read().decode()}")
            for line in reply.iter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.perf_counter() - clock
        return {"ready_s": ready, "ttft_s": ttft if ttft is not None else float("nan")}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


HF_START = """
import sys, time, torch, transformers
clock = time.perf_counter()
load = transformers.AutoModelForCausalLM.from_pretrained
model = load(sys.argv[1], dtype=torch.bfloat16, device_map="cuda")
model.generation_config.cache_implementation = "static"  # generate then compiles the forward itself
ids = torch.arange(100, 228, device="cuda")[None]
model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
torch.cuda.synchronize()
print(time.perf_counter() - clock)
"""


def hf_start(path: Path) -> float:
    """transformers in a fresh process: load, compile, and the first tokens (its time to serve)."""
    clock = time.perf_counter()
    subprocess.run([sys.executable, "-c", HF_START, str(path)], check=True, capture_output=True)
    return time.perf_counter() - clock


def save(result: dict) -> None:
    """After every measurement: a run cut short still reports what it measured."""
    Path(result["out"]).write_text(json.dumps(result, indent=2))


def free_gpu() -> None:
    gc.collect()  # an engine's reference cycles (CUDA graphs, wrappers) hold its memory until collected
    torch.cuda.empty_cache()


def batch1_phase(path: Path, result: dict, skip_hf: bool) -> None:
    model = hf_model(path, meta=skip_hf)  # kiln-only runs read no 16 GB for the step's byte count
    prompt_len, new = 128, 256
    per_step = step_bytes(model, prompt_len + new / 2)
    tps = kiln_batch1(path, prompt_len, new, result)
    result["batch1_kiln_tok_s"] = tps
    result["batch1_kiln_bandwidth_fraction"] = per_step * tps / (result["copy_bandwidth_gbs"] * 1e9)
    log.info(
        "kiln batch-1: %.1f tok/s, %.1f%% of copy bandwidth",
        tps,
        100 * result["batch1_kiln_bandwidth_fraction"],
    )
    save(result)
    if not skip_hf:
        hf = hf_batch1(model, prompt_len, new)
        result["batch1_hf_tok_s"] = hf
        result["batch1_ratio"] = tps / hf
        log.info("transformers batch-1: %.1f tok/s (kiln %.2fx)", hf, tps / hf)
    del model
    free_gpu()


def throughput_phase(path: Path, result: dict, skip_hf: bool) -> None:
    random_model("Qwen3Config", QWEN3_06B, path)
    work = workload()
    result["throughput_kiln_tok_s"] = kiln_throughput(path, work, result)
    log.info("kiln throughput: %.0f output tok/s", result["throughput_kiln_tok_s"])
    save(result)
    free_gpu()
    if not skip_hf:
        hf = hf_throughput(hf_model(path), work)
        result["throughput_hf_tok_s"] = hf
        result["throughput_ratio"] = result["throughput_kiln_tok_s"] / hf
        log.info("transformers throughput: %.0f output tok/s (kiln %.2fx)", hf, result["throughput_ratio"])
    free_gpu()


def engine_flags() -> list[str]:
    """KILN_OPTIONS as `kiln serve`/`kiln warmup` flags: both must run the engine the compile cache's
    entry was built for."""
    return [
        *(["--deterministic"] if KILN_OPTIONS.get("deterministic") else []),
        *(["--no-async-scheduling"] if KILN_OPTIONS.get("async_scheduling") is False else []),
    ]


def profile_warm_start(path: Path, cache_dir: Path, out: Path) -> None:
    """A warm `kiln warmup` under cProfile, which sees the engine's whole start (on the main thread, where
    `kiln serve` starts it on its own): writes the profile and logs where its seconds went, by function."""
    prof = out.resolve().with_suffix(".warmup.prof")  # the child runs in cache_dir
    cmd = [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "kiln", "warmup", "--model",
           str(path.resolve()), "--max-model-len", "4096", "--no-progress", *engine_flags()]  # fmt: skip
    env = {**os.environ, "KILN_CACHE_DIR": str(cache_dir)}
    cache_dir.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cache_dir, capture_output=True, text=True)
    if done.returncode != 0:  # the start-up figures are saved already; transformers' start still runs
        log.error("warm kiln warmup under cProfile failed (%d):\n%s", done.returncode, done.stderr[-4000:])
        return
    text = io.StringIO()
    stats = pstats.Stats(str(prof), stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    top = text.getvalue()
    stats.sort_stats("tottime").print_stats(30)
    out.with_suffix(".warmup.txt").write_text(text.getvalue())
    log.info("warm kiln warmup under cProfile: %.1f s; by cumulative time:\n%s",
             time.perf_counter() - clock, top[:8000])  # fmt: skip


def startup_phase(path: Path, cache: Path, out: Path, result: dict, skip_hf: bool) -> None:
    """Cold: an empty compile cache, but FlashInfer's kernels built (as a pip-installed jit-cache would
    have them); warm: the cache the cold start left."""
    jit = Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln")) / "flashinfer"
    if jit.is_dir():
        shutil.copytree(jit, cache / "flashinfer", symlinks=True)
    for start in ("cold", "warm"):
        got = serve_start(path, cache, out.with_suffix(".serve.log"))
        result[f"startup_{start}_ready_s"], result[f"startup_{start}_ttft_s"] = got["ready_s"], got["ttft_s"]
        log.info("kiln serve %s: ready in %.1f s, first request's TTFT %.3f s", start, *got.values())
        save(result)
    profile_warm_start(path, cache, out)
    if not skip_hf:
        result["startup_hf_s"] = hf_start(path)
        log.info("transformers: load, compile and first tokens in %.1f s", result["startup_hf_s"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument(
        "--skip-hf",
        nargs="*",
        choices=PHASES,
        help="kiln only: in these phases, or in every phase where none is named (transformers' throughput "
        "alone takes minutes)",
    )
    parser.add_argument(
        "--models", type=Path, help="keep the random model folders here, to reuse in a later run (A/B runs)"
    )
    parser.add_argument("--deterministic", action="store_true", help="kiln's batch-invariant mode")
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="schedule one step at a time (for an A/B)"
    )
    parser.add_argument(
        "--kernels",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="backend.kernels, not startup's",
    )
    args = parser.parse_args()
    # gpu_check.sh's deadline ends a run with SIGTERM: as an exception, the phase's `finally` still stops the
    # `kiln serve` it started, which would otherwise hold the GPU's memory from the tests that run next.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    skip_hf = set(PHASES if args.skip_hf == [] else args.skip_hf or ())
    KILN_OPTIONS["deterministic"] = args.deterministic
    if args.kernels != "auto":
        KILN_OPTIONS["kernels"] = args.kernels  # startup's kiln serve keeps auto
    if args.no_async_scheduling:
        KILN_OPTIONS["async_scheduling"] = False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "host": platform.node(),
        "phases": args.phases,
        "deterministic": args.deterministic,
        "async_scheduling": not args.no_async_scheduling,
        "kernels": args.kernels,
        "skip_hf": sorted(skip_hf),
        "out": str(args.out),
    }

    result["copy_bandwidth_gbs"] = copy_bandwidth() / 1e9
    log.info("copy bandwidth %.0f GB/s", result["copy_bandwidth_gbs"])
    save(result)
    with tempfile.TemporaryDirectory() as tmp:
        models = args.models or Path(tmp)
        llama = models / "llama3-8b"
        if "batch1" in args.phases or "startup" in args.phases:
            random_model("LlamaConfig", LLAMA3_8B, llama)  # the folder; each phase loads what it runs
        for phase in args.phases:
            # A phase that fails leaves the next ones their run: a device lease has room for one call.
            try:
                if phase == "batch1":
                    batch1_phase(llama, result, phase in skip_hf)
                elif phase == "throughput":
                    throughput_phase(models / "qwen3-0.6b", result, phase in skip_hf)
                elif phase == "startup":
                    startup_phase(llama, Path(tmp) / "kiln-cache", args.out, result, phase in skip_hf)
            except Exception as e:
                log.exception("phase %s failed", phase)
                result.setdefault("failed", {})[phase] = f"{type(e).__name__}: {e}"
            free_gpu()  # out of the except block, whose traceback holds the phase's engine
            save(result)
    log.info("results: %s\n%s", args.out, json.dumps(result, indent=2))
    if "failed" in result:
        sys.exit(f"failed phases: {', '.join(result['failed'])}")


if __name__ == "__main__":
    main()

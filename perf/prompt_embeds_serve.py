"""Serving prompts given as embeddings (vLLM's prompt_embeds, both servers started with
--enable-prompt-embeds): each request a fresh prompt of input-len rows, the embeddings of random token ids
(so no two requests share a cached prefix), base64 torch.save'd in bfloat16, with no `prompt` (vLLM 0.32
refuses `"prompt": ""` beside them: "The decoder prompt cannot be empty");
output-len tokens out, greedy, ignore_eos, streamed; at each concurrency, against one server URL.
With --chat the rows are a chat's content part ({"type": "prompt_embeds"}) after a text part, through
/v1/chat/completions and the model's chat template. Reports output tok/s, TTFT p50 and TPOT p50, and checks
every request gave output-len tokens.

    python perf/prompt_embeds_serve.py --url http://127.0.0.1:8000 --model-dir <the served folder> \
        --input-len 128 --output-len 128 --concurrency 1 16 --num-prompts 32 [--chat] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time
from pathlib import Path

import httpx
import torch
from safetensors import safe_open


def embedding_matrix(model_dir: Path) -> torch.Tensor:
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith("embed_tokens.weight"):
                    return f.get_tensor(name)
    raise SystemExit(f"no embed_tokens.weight in {model_dir}")


def payloads(weight: torch.Tensor, n: int, length: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(100, 10000, (length,), generator=g)
        buffer = io.BytesIO()
        torch.save(weight[ids].to(torch.bfloat16).clone(), buffer)
        out.append(base64.b64encode(buffer.getvalue()).decode())
    return out


async def one(
    client: httpx.AsyncClient, url: str, model: str, embeds: str, output_len: int, chat: bool
) -> dict:
    body = {
        "model": model, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if chat:
        part = {"type": "prompt_embeds", "data": embeds}
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "Summarize:"}, part]}]
    else:
        body["prompt_embeds"] = embeds
    start = time.perf_counter()
    first, tokens = None, 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", f"{url}{path}", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            choice = event["choices"][0] if event["choices"] else {}
            text = choice.get("delta", {}).get("content") if chat else choice.get("text")
            if text and first is None:
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    assert first is not None and tokens == output_len, (tokens, output_len)
    return {"ttft": first - start, "tpot": (end - first) / max(tokens - 1, 1), "end": end}


async def point(
    url: str, model: str, embeds: list[str], output_len: int, concurrency: int, chat: bool
) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def run(e: str) -> dict:
            async with limit:
                return await one(client, url, model, e, output_len, chat)

        await run(embeds[0])  # warm
        start = time.perf_counter()
        records = await asyncio.gather(*(run(e) for e in embeds[1:]))
    wall = max(r["end"] for r in records) - start
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "output_tok_s": len(records) * output_len / wall,
        "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in records),
        "tpot_p50_ms": 1000 * statistics.median(r["tpot"] for r in records),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="a chat content part, not completions' field")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    weight = embedding_matrix(args.model_dir)
    results = []
    for i, c in enumerate(args.concurrency):
        n = max(args.num_prompts, c) + 1
        embeds = payloads(weight, n, args.input_len, args.seed + 1000 * i)
        results.append(asyncio.run(point(args.url, model, embeds, args.output_len, c, args.chat)))
        r = results[-1]
        print(
            f"c{c}: {r['output_tok_s']:.1f} output tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
            f"TPOT p50 {r['tpot_p50_ms']:.1f} ms ({r['requests']} requests)"
        )
    if args.json:
        args.json.write_text(json.dumps({"url": args.url, "model": model, "points": results}, indent=1))


if __name__ == "__main__":
    main()

"""The offline mode: the same spec driven straight into LLMEngine, without HTTP, timed per step."""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from dataclasses import dataclass

from kiln.config import EngineConfig
from kiln.engine.engine import LLMEngine
from kiln.perf.client import arrival_gaps
from kiln.perf.dataset import Prompt
from kiln.perf.metrics import RequestRecord
from kiln.perf.run import Result, sweep
from kiln.perf.spec import Spec
from kiln.sampling_params import SamplingParams


@dataclass(slots=True)
class _Live:
    record: RequestRecord
    start: float
    last: float = 0.0


def run_offline(config: EngineConfig, spec: Spec, label: str) -> Result:
    engine = LLMEngine(config)
    engine.warmup()
    ids = itertools.count()

    def drive(
        prompts: list[Prompt], load: tuple[str, float], rng: random.Random, name: str
    ) -> tuple[list[RequestRecord], float]:
        kind, value = load
        limit = int(value) if kind == "concurrency" else (spec.max_concurrency or len(prompts))
        gaps = arrival_gaps(value, spec.burstiness, len(prompts), rng) if kind == "request_rate" else None
        arrivals = list(itertools.accumulate(gaps)) if gaps else [0.0] * len(prompts)
        live: dict[str, _Live] = {}
        records: list[RequestRecord] = []
        start = time.perf_counter()
        queue = deque(zip(arrivals, prompts, strict=True))
        while queue or live:
            now = time.perf_counter()
            while queue and len(live) < limit and queue[0][0] <= now - start:
                _, p = queue.popleft()
                rid = f"perf-{next(ids)}"
                prompt_ids = engine.admission.tokenize(p.prompt)
                record = RequestRecord(prompt_tokens=len(prompt_ids))
                records.append(record)
                params = SamplingParams(
                    temperature=spec.temperature, max_tokens=p.max_tokens, ignore_eos=spec.ignore_eos
                )
                engine.add_request(rid, prompt_ids, params)
                live[rid] = _Live(record, now)
            if not live:
                time.sleep(max(0.0, queue[0][0] - (time.perf_counter() - start)))
                continue
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                state = live[out.request_id]
                r = state.record
                new = len(out.outputs[0].token_ids)  # a delta
                if new:
                    if r.ttft == 0.0:
                        r.ttft = now - state.start
                    else:
                        r.itl.append(now - state.last)
                    state.last = now
                    r.output_tokens += new
                if out.finished:
                    r.latency, r.success = now - state.start, True
                    del live[out.request_id]
        return records, time.perf_counter() - start

    target = {"offline": True, "engine_config": config}
    return sweep(spec, drive, label, target, engine.model.dims.vocab_size)

"""One start of kiln in a process of its own: `python -m tests.compile.start MODEL OPTIONS_JSON` warms up,
generates greedily through every graph class, and prints JSON: the tokens, how each graph class was made
("loaded" from the compile cache entry, or "traced"), torch's compile counters after generating, and the
entry's folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

from kiln import LLM, SamplingParams
from kiln.compile.reports import compile_counters


def main() -> None:
    model, options = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model, **options)
    made = {name: "loaded" if s.loaded else "traced" for name, s in llm.engine.runner.lowering.steps.items()}
    report = {"tokens": generate(llm), "graphs": made, "counters": compile_counters()}
    sys.stdout.write(json.dumps(report | {"entry": str(llm.engine.compile_cache.dir)}) + "\n")


def generate(llm: LLM) -> list[list[int]]:
    """Greedy tokens through every graph class: decode batches of one, then of several."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([[5, 9, 13]], greedy, use_tqdm=False)
    many = llm.generate(
        [[(7 * i + n) % 200 + 1 for i in range(n)] for n in (1, 4, 17, 40)], greedy, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in alone + many]


def run(model: Path, cache: Path, **options: object) -> dict:
    """This module's main in a process of its own, with KILN_CACHE_DIR=cache; its JSON report."""
    cmd = [sys.executable, "-m", "tests.compile.start", str(model), json.dumps(options)]
    out = subprocess.run(
        cmd, env={**os.environ, "KILN_CACHE_DIR": str(cache)}, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


if __name__ == "__main__":
    main()

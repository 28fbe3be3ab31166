"""What hashing a prompt's prefix-cache blocks costs: BlockManager.update_hashes over one 2048-token prompt
(64 blocks of 32, the CPU's block size), best of 5 repeats. Run it against two trees to compare them:

    cd /tmp && PYTHONPATH=<tree> python /work/main/perf/prefix_hash.py
"""

from __future__ import annotations

import random
import timeit

import kiln
from kiln.engine.block_manager import BlockManager
from kiln.engine.request import Request
from kiln.sampling_params import SamplingParams

TOKENS, BLOCK, NUMBER = 2048, 32, 300


def main() -> None:
    manager = BlockManager(TOKENS // BLOCK, BLOCK)
    rng = random.Random(0)
    ids = [rng.randrange(49152) for _ in range(TOKENS)]
    params = SamplingParams()

    def hash_prompt() -> None:
        req = Request("r", "r", params, ids, TOKENS, 1, None)  # type: ignore[arg-type]
        manager.update_hashes(req)

    best = min(timeit.repeat(hash_prompt, number=NUMBER, repeat=5)) / NUMBER
    print(f"{kiln.__file__}: {best * 1e6:.1f} us per {TOKENS}-token prompt")


if __name__ == "__main__":
    main()

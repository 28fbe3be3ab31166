"""The chat template's render of a typical two-message chat (a system prompt and a ~100-word question), as
the API renders it (kiln.api.chat_render), on the default model's tokenizer: microseconds a render, median
of 5 runs of 500. To time another checkout, put it first on the path:

    cd /tmp && PYTHONPATH=<tree> python /work/main/perf/chat_render.py <label>
"""

import statistics
import sys
import time
from pathlib import Path

import msgspec
from transformers import AutoTokenizer

from kiln.api.protocol import ChatCompletionRequest

try:
    from kiln.api.chat_render import render_prompt as render
except ImportError:  # trees before render_prompt
    from kiln.api.chat_render import render_messages as render  # type: ignore[attr-defined,no-redef]

tok = AutoTokenizer.from_pretrained(Path.home() / ".cache/kiln/models/SmolLM2-135M-Instruct")
chat = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 5},
        {"role": "user", "content": "Tell me about the history of Paris, its rivers and its bridges. " * 8},
    ],
}
body = msgspec.json.decode(msgspec.json.encode(chat), type=ChatCompletionRequest)
for _ in range(50):
    render(tok, body.messages, body)
runs = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(500):
        render(tok, body.messages, body)
    runs.append((time.perf_counter() - t) / 500 * 1e6)
label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
print(label, [round(r, 1) for r in runs], "us; median", round(statistics.median(runs), 1))

"""`kiln perf`: load sweeps against any OpenAI-compatible endpoint (or the engine offline), with vLLM's
metric definitions, reports, comparisons and plots."""

"""kiln: an LLM serving stack whose speed comes from the compiler."""

from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.llm import LLM
from kiln.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

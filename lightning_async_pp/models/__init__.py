"""Example models built on ``PipelineModule``, and adapters of upstream models (``HuggingFaceCausalLM`` needs the
``hf`` extra, ``LitGPT`` the ``litgpt`` extra; both import their library only when built)."""
from lightning_async_pp.models.gpt import GPT
from lightning_async_pp.models.huggingface import HuggingFaceCausalLM
from lightning_async_pp.models.litgpt_model import LitGPT
from lightning_async_pp.models.llama import Llama
from lightning_async_pp.models.vocab import model_vocab_size

__all__ = ["GPT", "HuggingFaceCausalLM", "LitGPT", "Llama", "model_vocab_size"]

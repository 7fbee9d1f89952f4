"""Chapter 11's serving engine: a few small files, two planes (nano-vllm's shape).

Control plane (host values only): ``policies`` (block keys, admission, drain, routing),
``sequence``, ``block_manager`` (paged KV blocks and the adapter-keyed prefix cache), ``scheduler``.
Data plane: ``model_runner`` (a Llama forward over the paged cache, chapter 07's LoRA layers) and
``cuda_graph_runner`` (its decode steps through chapter 08's CUDA graphs: static buffers per bucket).
``llm`` joins them behind vLLM's offline API: ``LLM(model).generate(prompts, params, lora_request=...)``.
"""
from reference.engine.llm import LLM, EngineConfig, EnginePolicies, RequestOutput
from reference.engine.sequence import SamplingParams

__all__ = ["LLM", "EngineConfig", "EnginePolicies", "RequestOutput", "SamplingParams"]

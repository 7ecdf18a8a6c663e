"""quickdraft inside other inference engines.

:mod:`quickdraft.integrations.vllm_plugin`
    a vLLM general plugin (``pip install 'quickdraft[vllm]'``): quickdraft's acceptance rules in
    vLLM's speculative decoding, per engine and per request (docs/vllm.md).
"""

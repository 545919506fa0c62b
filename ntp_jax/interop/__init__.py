"""Hugging Face Llama in and out.

- ``hf_llama``: a ``LlamaForCausalLM`` folder's safetensors weights as logical state.
- ``export_hf``: a run's checkpoint as such a folder (``python -m ntp_jax.interop.export_hf``).
- ``hf_tokenizer``: the run's BPE tokenizer as the folder's ``tokenizer.json`` and configs.

Source followed: the transformers Llama model and its safetensors layout.
"""

"""Built-in model backends: native (paged Llama family) and transformers (any causal LM)."""

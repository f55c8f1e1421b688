"""Integrations with the stacks users train with. ``longtrain.integrations.hf``: Hugging Face transformers (the
``[hf]`` extra, imported lazily) and FSDP2 gradient scaling under context parallelism."""

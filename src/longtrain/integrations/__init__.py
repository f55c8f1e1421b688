"""Integrations with the stacks users train with: ``longtrain.integrations.hf`` (Hugging Face transformers, the
``[hf]`` extra), ``longtrain.integrations.torchtitan`` (torchtitan's decoders), both imported lazily, and
``longtrain.integrations.fsdp`` (FSDP2 gradient scaling under context parallelism, re-exported by both)."""

"""Model loading: finding a checkpoint, reading GGUF, the builtin checkpoints, devices and backend choice.

    checkpoints.py        model.path -> a checkpoint directory or GGUF file, its config and tokenizer
    gguf.py               GGUF metadata, tensors and tokenizer
    fingerprint.py        the checkpoint id every cache key carries
    builtin_models.py     builtin: checkpoints (seeded random weights) written on first use
    builtin_tokenizer.py  their tokenizer
    devices.py            device, weight and KV dtypes from settings
    backend_choice.py     which backend runs a checkpoint (``model.backend = "auto"``)
"""

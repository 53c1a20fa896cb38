"""Model pieces shared across families, applied from outside the model: LoRA adapters
(`lora.py`: the `LoRALinear` module swap, PEFT-compatible save/load, merge, QLoRA's NF4 base)."""

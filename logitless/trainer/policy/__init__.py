"""The trained policy: model and tokenizer loading, LoRA/QLoRA through peft, the reference policy, compiled layers
(`modeling`); activations and training state offloaded to host memory (`offload`)."""

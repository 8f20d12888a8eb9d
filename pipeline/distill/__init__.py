"""Recovery by distillation: a compressed student (2:4, quantized, or both) trained on the float teacher's logits
(`network`: the checkpoint as a trainable network, quantization-aware; `stage`: `trtpipe distill`)."""

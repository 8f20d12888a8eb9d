"""The decoder as ONNX (`trtpipe export-onnx`) and ONNX Runtime serving it; the export's file names."""

MODEL_FILE, DATA_FILE, CONFIG_FILE = "model.onnx", "model.onnx.data", "genai_config.json"
#: the graph's optional input that limits logits to the last N positions (0, its default: all), as transformers'
#: `logits_to_keep`: a prefill that needs only its last token's logits skips the lm_head over the rest of the prompt
LOGITS_TO_KEEP = "logits_to_keep"

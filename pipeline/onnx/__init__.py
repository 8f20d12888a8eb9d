"""The decoder as ONNX (`trtpipe export-onnx`) and ONNX Runtime serving it; the export's file names."""

MODEL_FILE, DATA_FILE, CONFIG_FILE = "model.onnx", "model.onnx.data", "genai_config.json"

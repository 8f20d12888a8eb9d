"""The precisions trtpipe builds and the TensorRT-LLM names they map to, defined once (no torch here:
the CLI imports this at start-up)."""

#: weight precisions plan and build take, as the command line spells them
PRECISIONS = ("fp16", "bf16", "fp32", "fp8", "int8-sq", "int4-awq")
#: `--precision auto` tries these in order, highest quality first, and plans the first that fits
AUTO_PRECISIONS = ("bf16", "fp8", "int8-sq", "int4-awq")
AUTO = "auto"
#: bits of a weight at each precision (a lower precision: fewer), before its scales
WEIGHT_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8-sq": 8, "int4-awq": 4}
#: unquantized precisions -> checkpoint dtype
FLOAT_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
#: quantized precisions -> checkpoint `quantization.quant_algo`
QUANT_ALGO = {"fp8": "FP8", "int8-sq": "W8A8_SQ_PER_CHANNEL", "int4-awq": "W4A16_AWQ"}
#: the precisions whose GEMMs quantize their input to 8 bits (the rest compute in the model dtype)
EIGHT_BIT_ACTIVATIONS = ("fp8", "int8-sq")
#: quantized KV caches -> checkpoint `quantization.kv_cache_quant_algo`
KV_CACHE_QUANT_ALGO = {"fp8": "FP8", "int8": "INT8"}
#: NVIDIA's 4-bit groupwise (AWQ) checkpoints, which calibrate writes and the reference runtime executes (plan and
#: build take W4A16_AWQ as int4-awq): `quantization.quant_algo` -> the number format of the GEMM's activations (None:
#: weight-only, float activations)
INT4_QUANT_ALGOS = {"W4A16_AWQ": None, "W4A8_AWQ": "fp8"}
#: 4-bit precisions, as calibrate spells them -> checkpoint `quantization.quant_algo`
INT4_PRECISIONS = {"int4-awq": "W4A16_AWQ", "w4a8-awq": "W4A8_AWQ"}
#: every precision calibrate writes -> its `quant_algo`
CALIBRATION_QUANT_ALGO = {**QUANT_ALGO, **INT4_PRECISIONS}
#: the group sizes of TensorRT-LLM's groupwise int4 GEMMs (fpA_intB_gemm_template.h, upstream-facts A1); the first that
#: divides every quantized input width is the default
INT4_GROUP_SIZES = (128, 64)
#: the one group size of its W4A(fp)8 GEMM ("Only group size 128 supported for fine grained W4A(fp)8 kernels")
W4A8_ENGINE_GROUP_SIZE = 128
#: signed int4 codes, two to a byte (docs/int4.md); modelopt's group scale maps the group's amax to INT4_MAX
INT4_MIN, INT4_MAX = -8, 7
#: --kv-cache of plan and build: auto (fp8 for fp8 weights, int8 for int8-sq, else unquantized), a float dtype or a
#: quantized one (calibrate --kv-cache offers the quantized ones alone: KV_CACHE_QUANT_ALGO)
KV_CACHE_CHOICES = ("auto", "fp16", "bf16", "fp32", *KV_CACHE_QUANT_ALGO)
#: checkpoint dtypes (and 8-bit element types) -> safetensors dtype code (pipeline.safetensors_stream)
DTYPE_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "fp8": "F8_E4M3", "int8": "I8"}
#: the dtypes a float checkpoint may have
CHECKPOINT_DTYPES = ("float16", "bfloat16", "float32")
#: the largest finite FP8 E4M3 value (float8_e4m3fn), which FP8 scales map amax to
E4M3_MAX = 448.0
#: what `calibrate --format` writes: the TensorRT-LLM checkpoint, both (+ OUT/hf), the Hugging Face one in modelopt's
#: layout alone, or vLLM's AWQ checkpoint alone (int4-awq)
CALIBRATION_FORMATS = ("trtllm", "both", "hf", "vllm")
#: the precision `calibrate --format vllm` writes (AutoAWQ's layout has no activation scales)
VLLM_FORMAT_PRECISIONS = ("int4-awq",)

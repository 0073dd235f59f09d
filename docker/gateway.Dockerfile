# syntax=docker/dockerfile:1
# The gateway: FastAPI + httpx in front of the workers. No torch: the base install only.
# Build from the repository root:  docker build -f docker/gateway.Dockerfile -t squeezeserve/gateway:0.1.0 .
# Upstreams come from the environment at run time (SQUEEZESERVE_GATEWAY_UPSTREAMS), API keys from a secret
# (SQUEEZESERVE_GATEWAY_API_KEYS): nothing secret is baked into the image.
#
# The base image is a build argument so the same file builds against Docker Hub (the default) and against a
# local mirror or stand-in where Docker Hub is out of reach, e.g.
#   docker build --build-arg PYTHON_IMAGE=local/python:3.11-bookworm -f docker/gateway.Dockerfile .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# Two stages: the build stage needs pip's build isolation (setuptools) and writes caches; the runtime stage
# copies only the finished virtual environment.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first, from pyproject alone: a source change reuses this layer and reinstalls only our package.
COPY pyproject.toml docker/requirements.py ./
RUN python requirements.py pyproject.toml > requirements.txt \
    && pip install --no-cache-dir --requirement requirements.txt
COPY README.md ./
COPY service ./service
COPY kernels ./kernels
# pip and setuptools are not needed at run time (about 20 MB less in the image).
RUN pip install --no-cache-dir --no-deps . \
    && pip uninstall --yes setuptools pip

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin squeezeserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/squeezeserve
EXPOSE 8000
# Liveness only (/livez): the process answers. Readiness (/readyz: at least one healthy upstream) is the
# orchestrator's business; compose and Kubernetes probe it themselves. Python, because slim has no curl.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/livez', timeout=2)"]
ENTRYPOINT ["squeezeserve"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8000"]

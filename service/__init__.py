"""squeezeserve: serve compressed LLMs behind an OpenAI-compatible gateway."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("squeezeserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

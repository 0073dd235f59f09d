"""Text that ships inside the package, so a fresh install can compress and validate with no download.

``sample:NAME`` names one of these files wherever a command takes a text file (``validate --dataset``,
``compress --calibration``): a laptop, a container and CI all have them. They are small slices of the
WikiText-2 splits (whole articles from the start of each file; CC BY-SA, see ``wikitext-2/README.md``),
enough for a quick check, not for a reportable perplexity: give the full split as a path for that.
"""

from __future__ import annotations

from pathlib import Path

PREFIX = "sample:"
_ROOT = Path(__file__).parent
SAMPLES = {
    "wikitext-2-test": _ROOT / "wikitext-2" / "test.txt",  # evaluation: perplexity, KL, top-1
    "wikitext-2-calibration": _ROOT / "wikitext-2" / "calibration.txt",  # GPTQ / Wanda calibration
}


def sample_path(name: str) -> Path:
    """The file behind ``sample:NAME``; ``KeyError`` names the known samples."""
    try:
        return SAMPLES[name]
    except KeyError:
        known = ", ".join(PREFIX + key for key in SAMPLES)
        raise KeyError(f"unknown sample {PREFIX}{name}; the package ships {known}") from None


def resolve(dataset: str) -> str:
    """``dataset`` with a ``sample:NAME`` replaced by its file's path; anything else unchanged."""
    if not dataset.startswith(PREFIX):
        return dataset
    return str(sample_path(dataset[len(PREFIX) :]))

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Compress and score on one thread: on the shared 2-core CI box, torch's 2-thread pool waits at every
    op for a core another job holds (measured: GPTQ of the bundled model 35 s on 1 thread, 83 s on 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

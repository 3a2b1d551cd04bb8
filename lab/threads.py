"""One torch thread: for a lesson's tiny tensors (thread start-up costs more than the work on 2 cores), and for the
supervised warm start, whose result must not depend on the machine's thread count (``lab.pretrain``)."""
from __future__ import annotations

import contextlib
import functools

import torch


@contextlib.contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_threaded(fn):
    """Decorator: run ``fn`` with one torch thread (restored afterwards)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with one_thread():
            return fn(*args, **kwargs)

    return wrapper

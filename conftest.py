import os
import socket

import pytest
import torch

os.environ.setdefault("LAB_QUIET", "1")


def _bring_loopback_up() -> None:
    """A fresh network namespace (``unshare -n``: no network at all) starts with its loopback interface down. Jupyter
    kernels (papermill) and a local Ray instance talk over 127.0.0.1 on this machine, so bring loopback up there
    (SIOCSIFFLAGS on "lo"; the namespace's owner may). Nothing outside the machine becomes reachable."""
    import fcntl
    import struct

    from lab.engine.sweep import loopback_works

    if loopback_works():
        return
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name, flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0)))
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", name, flags | IFF_UP))


_bring_loopback_up()

import toy_envs  # noqa: E402
from lab.policies import init_params, make_policy  # noqa: E402


# fixtures that build every report, train a model or run a sweep: a test using one is slow (``make test-fast`` leaves
# it out), whatever its module marks
SLOW_FIXTURES = {"gallery", "distill_cache"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def tiny():
    env = toy_envs.make("tiny_target")
    policy = make_policy("prefix", env)
    theta = init_params(policy, 1.0, torch.Generator().manual_seed(0))
    return env, policy, theta


@pytest.fixture(scope="session", autouse=True)
def failed_reports(tmp_path_factory):
    """Partially executed notebooks of failing reports go to a temporary folder, not the user's cache; the model
    warm-start cache ($LAB_CACHE_DIR or the user's) stays shared, so the tests reuse the models trained before."""
    folder = tmp_path_factory.mktemp("failed-reports")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAB_FAILED_REPORTS", str(folder))
        yield folder


@pytest.fixture(scope="session")
def gallery(tmp_path_factory):
    """Every report built once with its smoke parameters (two kernels at a time) plus the gallery index: the report
    tests and the teaching-notebook tests read the same real papermill executions."""
    from lab import reports

    out = tmp_path_factory.mktemp("reports")
    paths = reports.run_all(out, workers=2, smoke=True)
    assert paths == [out / r.name for r in reports.catalog().values() if r.gallery] + [out / "index.html"]
    return out


@pytest.fixture(scope="module")
def distill_cache(request, tmp_path_factory):
    """A per-module warm-start cache (also seen by sweep workers, which inherit the environment) holding the teacher
    of the module's ``TINY`` distillation setting, trained once."""
    from lab.engine.distill import DistillConfig, make_setup

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAB_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        make_setup(DistillConfig(**request.module.TINY))
        yield


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test (model loading must be offline)."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] if len(args) > 1 else args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """One torch thread: small decoding steps gain nothing from more, and a shared machine makes them wait."""
    yield from _one_torch_thread()


@pytest.fixture(scope="module")
def one_thread_module():
    """One torch thread for a whole module (its module-scoped fixtures, e.g. warm starts, included): tiny matrices
    are fastest on one thread, and it spares a busy machine's cores."""
    yield from _one_torch_thread()

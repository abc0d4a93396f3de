"""The HTTP reward client against a real server on 127.0.0.1."""

import socket
import threading

import pytest

from rlhf.rewards.remote import RemoteReward, RemoteRewardError
from rlhf.rewards.server import RewardServer


def length_reward(prompts, responses, **meta):
    return [float(len(r)) + float(m) for r, m in zip(responses, meta.get("bonus", [0] * len(responses)))]


@pytest.fixture
def server():
    s = RewardServer(length_reward).start()
    yield s
    s.close()


def test_batches_concurrency_and_order(server):
    client = RemoteReward([server.url], batch_size=3, concurrency=2, timeout_s=5)
    responses = ["x" * i for i in range(10)]
    out = client(["p"] * 10, responses, bonus=list(range(10)))
    assert out == [2.0 * i for i in range(10)]
    assert client.healthy() == [server.url]


def test_server_binds_loopback_by_default(server):
    assert server.url.startswith("http://127.0.0.1:")


def test_load_balances_and_fails_over_to_a_live_url(server):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens there now
    client = RemoteReward([dead_url, server.url], batch_size=2, concurrency=1, timeout_s=2, retries=2, backoff_s=0.01)
    assert client(["p"] * 4, ["a", "bb", "ccc", "dddd"]) == [1.0, 2.0, 3.0, 4.0]


def test_down_server_gives_clear_error_after_retries():
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    client = RemoteReward([url], timeout_s=1, retries=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=r"did not answer after 3 attempts"):
        client(["p"], ["r"])


def test_function_error_is_reported_not_fatal_to_server():
    calls = {"n": 0}

    def flaky(prompts, responses, **_):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return [1.0] * len(responses)

    s = RewardServer(flaky).start()
    try:
        client = RemoteReward([s.url], timeout_s=2, retries=1, backoff_s=0.01)
        assert client(["p"], ["r"]) == [1.0]  # first attempt got HTTP 500, the retry succeeded
    finally:
        s.close()


def test_wrong_count_is_an_error():
    s = RewardServer(lambda p, r, **_: [1.0]).start()
    try:
        client = RemoteReward([s.url], timeout_s=2, retries=0)
        with pytest.raises(RemoteRewardError, match="did not answer|wrong count"):
            client(["p", "q"], ["r", "s"])
    finally:
        s.close()


def test_timeout_then_error():
    release = threading.Event()

    def slow(prompts, responses, **_):
        release.wait(5)
        return [0.0] * len(responses)

    s = RewardServer(slow).start()
    try:
        client = RemoteReward([s.url], timeout_s=0.3, retries=1, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match="did not answer"):
            client(["p"], ["r"])
    finally:
        release.set()
        s.close()

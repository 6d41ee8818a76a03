"""examples/_common.py: the helpers every example shares."""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest
from _common import digits_28x28, digits_split, predict, server

from pergrad.client import GradientClient, PergradError
from tests.examples.helpers import EXAMPLES


def test_predict_is_the_argmax_of_the_models_logits(client: GradientClient) -> None:
    x, _ = digits_28x28()
    x = x[:64].reshape(64, 784)
    _, w = client.get_weights("mnist_mlp")
    hidden = np.maximum(x @ w["hidden/kernel"] + w["hidden/bias"], 0)
    logits = hidden @ w["logits/kernel"] + w["logits/bias"]
    np.testing.assert_array_equal(predict(client, "mnist_mlp", x, chunk=100), logits.argmax(1))


def test_digits_split_is_disjoint_and_shaped_for_the_models_input(
    client: GradientClient,
) -> None:
    x, y, x_test, y_test = digits_split(client, "mnist_mlp", test_size=300)
    assert x.shape == (1497, 784) and x_test.shape == (300, 784)
    assert len(y) == 1497 and len(y_test) == 300
    assert not {row.tobytes() for row in x} & {row.tobytes() for row in x_test}


def test_server_without_a_target_runs_a_local_one_until_exit() -> None:
    with server(None, "mnist_mlp") as target, GradientClient(target, timeout=60) as client:
        assert client.list_models() == ["mnist_mlp"]
    with pytest.raises(PergradError) as failure, GradientClient(target, timeout=5) as client:
        client.list_models()
    assert failure.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("name", ["dp_sgd", "tracin", "noise_scale"])
def test_every_example_explains_itself_with_help(name: str) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    assert "--target TARGET" in text
    assert "Without --target the script starts its own local `pergrad serve`" in text

"""Warnings that would be false: a `@grad` site that some calls could not watch but others
recorded (a GAN's discriminator input), a function the method only passes on to a library
that calls it (FlexAttention's `score_mod`) said to be "never called"."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from vartrace.tracing.tracer import ModelTracer


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _gan_steps(generator: nn.Module, discriminator: Discriminator, steps: int) -> None:
    g_opt = torch.optim.SGD(generator.parameters(), lr=0.01)
    d_opt = torch.optim.SGD(discriminator.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(2)
    for _ in range(steps):
        real = torch.randn(5, 4, generator=data)
        fake = generator(torch.randn(5, 3, generator=data))
        d_opt.zero_grad()  # the discriminator's step: its input has no gradient
        (discriminator(real).mean() - discriminator(fake.detach()).mean()).backward()
        d_opt.step()
        g_opt.zero_grad()  # the generator's step: the gradient reaches the fake input
        (-discriminator(fake).mean()).backward()
        g_opt.step()


@pytest.mark.warnings_as_errors
def test_a_gan_discriminator_input_recorded_at_some_calls_does_not_warn() -> None:
    torch.manual_seed(0)
    generator, discriminator = nn.Linear(3, 4), Discriminator()
    with (
        warnings.catch_warnings(),
        ModelTracer(generator, ["forward"], change_detection=False),
        ModelTracer(discriminator, ["forward.x@grad"], mode="any") as tracer,
    ):
        warnings.simplefilter("error")
        _gan_steps(generator, discriminator, 3)
    trace = tracer.results["forward.x@grad"]
    assert len(trace.values) == 3  # one per generator step, where x requires grad
    assert all(value.shape == (5, 4) for value in trace.values)


def test_a_site_that_never_required_grad_still_warns_once_at_stop() -> None:
    discriminator = Discriminator()
    with (
        pytest.warns(UserWarning, match=r"forward\.x@grad: the tensor does not require grad"),
        ModelTracer(discriminator, ["forward.x@grad"]),
    ):
        for _ in range(3):
            discriminator(torch.randn(5, 4)).mean().backward()


def rel_bias(
    score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
) -> torch.Tensor:
    bias = (q_idx - kv_idx) * 0.1
    return score + bias


def _scaled(x: torch.Tensor) -> torch.Tensor:
    half = x / 2
    return half


class Mapped(nn.Module):
    """Passes a function to `torch.func.vmap`, which calls it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.vmap(_scaled)(x)


class Branchy(nn.Module):
    """Calls a function by name, on a branch the run does not take."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e9:
            return _scaled(x)
        return x


class Flex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(1, 1, -1, 8)
        return flex_attention(q, q, q, score_mod=rel_bias)


def flex_attention(*args: torch.Tensor, score_mod: object) -> torch.Tensor:
    attention = pytest.importorskip("torch.nn.attention.flex_attention")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()": as users run it
        return attention.flex_attention(*args, score_mod=score_mod)


def _stop_warnings(model: nn.Module, pattern: str) -> list[str]:
    model.requires_grad_(False)  # FlexAttention has no backward on the CPU
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, [pattern, "forward"]):
            for _ in range(2):
                model(torch.randn(16, 8))
    return [str(w.message) for w in caught if "recorded nothing" in str(w.message)]


@pytest.mark.parametrize(
    ("model", "pattern"), [(Mapped(), "forward>_scaled.half"), (Flex(), "forward>rel_bias.bias")]
)
def test_a_function_only_passed_on_is_not_said_never_called(model: nn.Module, pattern: str) -> None:
    [message] = _stop_warnings(model, pattern)
    function = pattern.partition(">")[2].partition(".")[0]
    assert f"forward never calls {function} itself: it only passes it on" in message
    assert "was never called" not in message


def test_a_function_called_by_name_on_a_branch_not_taken_is_still_never_called() -> None:
    [message] = _stop_warnings(Branchy(), "forward>_scaled.half")
    assert "the function it is in was never called (forward>_scaled)" in message


class Aliased(nn.Module):
    """Binds the function to a local and calls it through that (HF's attention_interface),
    on a branch the run does not take."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        interface = _scaled
        if x.abs().max() > 1e9:
            return interface(x)
        return x


def test_a_function_called_through_a_local_is_not_said_passed_on() -> None:
    [message] = _stop_warnings(Aliased(), "forward>_scaled.half")
    assert "the function it is in was never called (forward>_scaled)" in message

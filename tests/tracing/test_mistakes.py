"""Mistakes a newcomer makes say what is wrong, when it can be said: none passes silently."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from vartrace import CallbackError, H5PYSaverCallback, ModelTracer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x))).sum()


def _train(tracer: ModelTracer, steps: int = 3) -> None:
    model = tracer.model
    with tracer:
        for _ in range(steps):
            model(torch.randn(2, 4)).backward()


def test_a_saver_outside_the_callbacks_is_reported_when_the_tracer_is_built(
    tmp_path: Path,
) -> None:
    saver = H5PYSaverCallback(tmp_path / "run.h5")
    with pytest.warns(UserWarning, match=r"not among this tracer's callbacks.*post_gather"):
        ModelTracer(Net(), ["head"])
    with pytest.raises(TypeError, match=r"pre_save_callbacks\[0\].*pass it in post_gather"):
        ModelTracer(Net(), ["head"], pre_save_callbacks=[saver])
    with pytest.raises(TypeError, match=r"post_gather_callbacks\[1\].*pass it in pre_save"):
        ModelTracer(Net(), ["head"], post_gather_callbacks=[saver, lambda n, v, i: v])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracer = ModelTracer(Net(), ["head"], post_gather_callbacks=[saver])
        _train(tracer)
    saver.close()
    with vartrace.open(tmp_path / "run.h5") as run:
        assert run["head.forward"].iterations.tolist() == [1, 2, 3]


def test_savers_made_up_front_for_two_tracers_are_not_reported(tmp_path: Path) -> None:
    first, second = H5PYSaverCallback(tmp_path / "a.h5"), H5PYSaverCallback(tmp_path / "b.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second saver is not reported by the first tracer
        _train(ModelTracer(Net(), ["head"], post_gather_callbacks=[first]))
        _train(ModelTracer(Net(), ["head"], post_gather_callbacks=[second]), steps=2)
    first.close()
    second.close()
    for name, iterations in (("a.h5", [1, 2, 3]), ("b.h5", [1, 2])):
        with vartrace.open(tmp_path / name) as run:
            assert run["head.forward"].iterations.tolist() == iterations


def test_a_callback_error_names_the_callback_and_the_site() -> None:
    def halve(name: str, value: Any, iteration: int) -> Any:
        raise ZeroDivisionError("no halves today")

    tracer = ModelTracer(Net(), ["head"], pre_save_callbacks=[halve])
    with pytest.raises(
        CallbackError, match=r"pre_save callback .*halve raised on site 'head\.forward'"
    ) as raised:
        _train(tracer)
    assert isinstance(raised.value.__cause__, ZeroDivisionError)

    def broken_sink(name: str, trace: Any) -> None:
        raise KeyError("disk")

    tracer = ModelTracer(Net(), ["head"], post_gather_callbacks=[broken_sink])
    with pytest.raises(
        CallbackError,
        match=r"post_gather callback .*broken_sink raised on site 'head\.forward': KeyError",
    ) as raised:
        _train(tracer)
    assert isinstance(raised.value.__cause__, KeyError)


def test_a_bad_compression_fails_in_the_constructor_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with pytest.raises(ValueError, match=r"unknown compression 'bloscc': did you mean 'blosc'"):
        H5PYSaverCallback(path, compression="bloscc")
    with pytest.raises(ValueError, match="compression 'gzip' cannot be used"):
        H5PYSaverCallback(path, compression="gzip", compression_opts=42)
    with pytest.raises(ValueError, match="compression 54321 cannot be used"):
        H5PYSaverCallback(path, compression=54321)
    assert not path.exists()
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hdf5plugin"] = None  # as if it were not installed
        from vartrace import H5PYSaverCallback
        try:
            H5PYSaverCallback({str(path)!r}, compression="blosc")
        except ImportError as error:
            print("ERROR", error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "ERROR" in result.stdout, result.stderr
    assert "pip install 'torch-vartrace[compress]'" in result.stdout
    assert not path.exists()


def test_a_run_that_wrote_no_record_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    model = Net().eval()  # the tracer traces training calls: nothing is recorded
    with (
        pytest.warns(UserWarning, match="received no record"),
        pytest.warns(UserWarning, match="only in eval mode, and this tracer has mode='train'"),
        H5PYSaverCallback(path) as saver,
        ModelTracer(model, ["head"], post_gather_callbacks=[saver]),
    ):
        model(torch.randn(2, 4))
    assert not path.exists()
    model.train()
    with H5PYSaverCallback(path) as saver:  # the retry does not meet FileExistsError
        _train(ModelTracer(model, ["head"], post_gather_callbacks=[saver]))
    with vartrace.open(path) as run:
        assert run["head.forward"].iterations.tolist() == [1, 2, 3]


def test_append_without_set_iteration_continues_the_numbering(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    model = Net()
    with H5PYSaverCallback(path) as saver:
        _train(ModelTracer(model, ["head", "body"], post_gather_callbacks=[saver]))
    with (
        pytest.warns(
            UserWarning, match=r"iterations up to 3.*stored as iterations 4.*set_iteration"
        ),
        H5PYSaverCallback(path, append=True) as saver,
    ):
        _train(ModelTracer(model, ["head", "body"], post_gather_callbacks=[saver]))
    with vartrace.open(path) as run:
        site = run["head.forward"]
        assert site.iterations.tolist() == [1, 2, 3, 4, 5, 6]
        assert len(set(site.order.tolist())) == 6 and (site.order[1:] > site.order[:-1]).all()
    with warnings.catch_warnings():  # numbering of one's own is kept as it is
        warnings.simplefilter("error")
        with H5PYSaverCallback(path, append=True) as saver:
            tracer = ModelTracer(model, ["head"], post_gather_callbacks=[saver])
            with tracer:
                tracer.set_iteration(10)
                model(torch.randn(2, 4))
    with vartrace.open(path) as run:
        assert run["head.forward"].iterations.tolist() == [1, 2, 3, 4, 5, 6, 10]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without a usable GPU")
def test_a_cuda_device_without_cuda_fails_at_construction() -> None:
    with pytest.raises(ValueError, match=r"device='cuda'.*device='cpu'"):
        ModelTracer(Net(), ["head"], device="cuda")


# -- misspelt names below a method that ends in a call (issue 22, item 1) ----------------------


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ x.transpose(-1, -2)
        h = logits.softmax(-1) @ x
        return self.proj(h)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class _Activation(nn.Module):
    """Hugging Face's GELUActivation: the function it applies is held by the instance."""

    def __init__(self, python: bool) -> None:
        super().__init__()
        self.act = self._python_gelu if python else nn.functional.gelu

    def _python_gelu(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.erf(x / 2.0**0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.acts = nn.ModuleList([_Activation(False), _Activation(True)])
        self.head = nn.Linear(4, 2)
        self.mixer = _Mixer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.acts[1](self.acts[0](self.mixer(x)["mixed"])))


def _mix(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"mixed": x.flip(-1), "gate": x.sigmoid()}


class _Mixer(nn.Module):
    """A method that returns what a function of its module's globals returns."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return _mix(x)


@pytest.mark.parametrize(
    ("pattern", "closest"),
    [
        ("mixer.forward.mixd", "mixer.forward.mixed"),  # a function of the globals, followed
        ("blocks.0.attn.forward.scores", "blocks.0.attn.forward.logits"),  # self.proj(h)
        ("head.forward.typo", "head.forward.input"),  # F.linear
        ("blocks.*.mlp.forward.qqq", "blocks.0.mlp.forward"),  # nn.Sequential
        ("blocks.0.forward.lgoits", "blocks.0.forward.x"),  # a submodule's call, followed
        ("acts.*.forward.qqq", "acts.0.forward"),  # a function held by the instance
    ],
)
def test_a_misspelt_key_below_a_returned_call_is_refused_before_step_one(
    pattern: str, closest: str
) -> None:
    with pytest.raises(ValueError, match=rf"{re.escape(pattern)}' matches no site.*{closest}"):
        ModelTracer(_Stack(), [pattern])


def test_two_patterns_joined_by_a_comma_are_refused_with_the_list_to_pass() -> None:
    message = r"pass several as a list, \['blocks\.0\.attn\.forward\.logits', 'head'\]"
    with pytest.raises(ValueError, match=message):
        ModelTracer(_Stack(), "blocks.0.attn.forward.logits, head")


def test_keys_a_returned_call_can_have_are_accepted() -> None:
    model = _Stack()
    patterns = [
        "blocks.0.attn.forward.logits",
        "head.forward.shape",
        "blocks.1.mlp.forward.ndim",
        "mixer.forward.gate",
    ]
    x = torch.randn(3, 2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, patterns) as tracer:
            model(x)
    assert sorted(tracer.results) == [
        "blocks.0.attn.forward.logits",
        "blocks.1.mlp.forward.ndim",
        "head.forward.shape.0",
        "head.forward.shape.1",
        "head.forward.shape.2",
        "mixer.forward.gate",
    ]
    with torch.no_grad():
        expected = _mix(model.blocks[1](model.blocks[0](x)))["gate"]
    torch.testing.assert_close(tracer.results["mixer.forward.gate"].values[0], expected)


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.proj(x)}


class _Checkpointed(nn.Module):
    """A torch function that returns what the module it runs returns."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> Any:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


class _Functional(_Checkpointed):
    """The same, from a torch function annotated ``-> Any``."""

    def forward(self, x: torch.Tensor) -> Any:
        return torch.func.functional_call(self.inner, dict(self.inner.named_parameters()), (x,))


@pytest.mark.parametrize("kind", [_Checkpointed, _Functional])
def test_torch_functions_returning_what_a_module_returns_are_not_taken_for_tensors(
    kind: type[nn.Module],
) -> None:
    model = kind()
    with ModelTracer(model, ["forward.logits"]) as tracer:
        model(torch.randn(2, 4))
    assert list(tracer.results) == ["forward.logits"]


@pytest.mark.parametrize("everywhere", [False, True])
def test_a_forward_hook_may_change_what_a_submodule_returns(everywhere: bool) -> None:
    model = _Stack()

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        return {"out": out, "top": out.max()} if module is model.head else None

    register = nn.modules.module.register_module_forward_hook
    handle = register(hook) if everywhere else model.head.register_forward_hook(hook)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with ModelTracer(model, ["forward.top"]) as tracer:
                model(torch.randn(3, 2, 4))
    finally:
        handle.remove()
    assert list(tracer.results) == ["forward.top"]


def test_strict_false_keeps_a_misspelt_key_and_warns_at_its_first_return() -> None:
    model = _Stack()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracer = ModelTracer(model, ["head.forward.typo"], strict=False)
        assert not caught
        with tracer:
            model(torch.randn(3, 2, 4))
            first = [str(w.message) for w in caught]
    assert len(first) == len(caught) == 1, first
    assert "'head.forward.typo': head.forward returned a Tensor which has no keys" in first[0]


def test_grad_sites_warn_about_no_grad_evaluations_only_when_no_step_recorded() -> None:
    model = Net()

    def evaluate() -> None:
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4))
        model.train()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["body@grad"], mode="any") as tracer:
            evaluate()
            model(torch.randn(2, 4)).backward()
            evaluate()
    assert list(tracer.results["body.forward@grad"].iterations) == [2]
    message = r"no gradient is recorded for body\.forward@grad: the tensor does not require grad"
    with pytest.warns(UserWarning, match=message), ModelTracer(model, ["body@grad"], mode="any"):
        evaluate()


def _clipped(x: torch.Tensor) -> torch.Tensor:
    if x.abs().max() > 1e9:
        rare = x.clamp(-1e9, 1e9)
        return rare
    return x


class _Branchy(nn.Module):
    def forward(self, x: torch.Tensor, clip: bool = False) -> torch.Tensor:
        if x.abs().max() > 1e9:
            huge = x.abs().max()
            print(huge)
        return _clipped(x) if clip else x + 1


def test_recorded_nothing_tells_a_function_never_called_from_a_variable_never_bound() -> None:
    model = _Branchy()
    patterns = ["forward.huge", "forward>_clipped.rare"]
    never_called, unbound = "the function it is in was never called", "the variable was never bound"
    for clip, reason in ((False, never_called), (True, unbound)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ModelTracer(model, patterns):
                model(torch.ones(2), clip=clip)
        messages = sorted(str(w.message) for w in caught)
        assert len(messages) == 2, messages
        assert "'forward.huge' recorded nothing: the variable was never bound" in messages[0]
        assert f"'forward>_clipped.rare' recorded nothing: {reason}" in messages[1]


def test_a_group_that_is_not_a_process_group_is_refused() -> None:
    with pytest.raises(TypeError, match=r"group must be a torch.distributed process group"):
        ModelTracer(Net(), ["body"], group=[0, 1])

"""The simgpu stand-in accelerator: its sync log, asynchronous copies, streams and models."""

from __future__ import annotations

import copy
import importlib
import os
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests import simgpu
from tests._models import TinyTransformer, tokens
from tests.simgpu import DEVICE, LOG, peek, to_device

# Long enough that a copy cannot land between two Python statements; the first delay drawn
# after set_copy_delay(SLOW, seed=0) is 0.84 * SLOW.
SLOW = 0.3


@pytest.fixture(autouse=True)
def _clean_log() -> Iterator[None]:
    simgpu.synchronize()
    LOG.clear()
    yield
    simgpu.synchronize()
    LOG.clear()


def ops() -> list[str]:
    return [e.op for e in LOG.events]


def poisoned(t: torch.Tensor) -> bool:
    return bool((t.reshape(-1).view(torch.uint8) == 0xFF).all())


# -- registration ------------------------------------------------------------------------------


def test_backend_is_registered_once() -> None:
    assert torch._C._get_privateuse1_backend_name() == "simgpu"
    assert torch.get_device_module("simgpu") is simgpu.BACKEND is torch.simgpu
    assert importlib.import_module("tests.simgpu") is simgpu
    module = torch.simgpu
    assert module.is_available() and module.device_count() == 1 and module.current_device() == 0
    assert module.current_stream() is module.default_stream()
    x = to_device(torch.ones(2))
    assert x.device == DEVICE and not x.is_cpu and x.device.type == "simgpu"


def test_torch_device_discovery_does_not_pick_the_stand_in() -> None:
    assert torch.simgpu.is_available()
    assert not torch.accelerator.is_available()
    model = nn.Linear(2, 2)
    wrapped = nn.DataParallel(model)  # would move the model to an available accelerator
    assert wrapped.device_ids == [] and model.weight.is_cpu


def test_tensor_conveniences() -> None:
    x = to_device(torch.arange(4.0))
    assert f"{x[1]:.1f}" == "1.0"
    moved = to_device(torch.zeros(4))
    moved.data = x.clone()
    assert torch.equal(peek(moved), torch.arange(4.0))
    assert torch.equal(peek(copy.deepcopy(x)), torch.arange(4.0))
    assert ops() == ["aten._local_scalar_dense.default"]


def test_factories_make_device_tensors() -> None:
    assert torch.arange(5, device=DEVICE).shape == (5,)
    assert torch.eye(2, 3, device=DEVICE).shape == (2, 3)
    assert torch.equal(peek(torch.zeros(3, device=DEVICE)), torch.zeros(3))
    assert ops() == []
    made = torch.tensor([1.0, 2.0], device=DEVICE)  # a blocking host-to-device copy
    assert made.device == DEVICE and torch.equal(peek(made), torch.tensor([1.0, 2.0]))
    assert ops() == ["h2d aten._to_copy.default"]


def test_random_ops_use_the_cpu_generator() -> None:
    torch.manual_seed(3)
    on_device = torch.randn(4, device=DEVICE)
    torch.manual_seed(3)
    assert torch.equal(peek(on_device), torch.randn(4))


def test_pinned_memory_is_unavailable() -> None:
    with pytest.raises(RuntimeError, match="getPinnedMemoryAllocator"):
        torch.empty(4, pin_memory=True)
    with pytest.raises(RuntimeError, match="getPinnedMemoryAllocator"):
        torch.zeros(4).pin_memory()
    assert not torch.zeros(4).is_pinned()


def test_mixing_host_and_device_tensors_raises_as_on_cuda() -> None:
    x = to_device(torch.ones(3))
    with pytest.raises(RuntimeError, match="same device"):
        _ = x + torch.ones(3)
    assert torch.equal(peek(x + torch.tensor(1.0)), torch.full((3,), 2.0))  # a CPU scalar: fine


# -- the sync log ------------------------------------------------------------------------------


def _host() -> torch.Tensor:
    return torch.empty(4)


SYNCS: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "item": (lambda x: x.sum().item(), "aten._local_scalar_dense.default"),
    "bool": (lambda x: bool(x[0] > 0), "aten._local_scalar_dense.default"),
    "equal": (lambda x: torch.equal(x, x), "aten.equal.default"),
    "nonzero": (lambda x: x.nonzero(), "aten.nonzero.default"),
    "cpu": (lambda x: x.cpu(), "d2h aten._to_copy.default"),
    "to cpu": (lambda x: x.to("cpu"), "d2h aten._to_copy.default"),
    "tolist": (lambda x: x.tolist(), "d2h aten._to_copy.default"),
    "copy_ d2h": (lambda x: _host().copy_(x), "d2h aten.copy_.default"),
    "copy_ h2d": (lambda x: x.copy_(torch.zeros(4)), "h2d aten.copy_.default"),
    "to device": (lambda x: torch.zeros(4).to(DEVICE), "h2d aten._to_copy.default"),
    "repr": (repr, "repr"),
    "Event.synchronize": (
        lambda x: simgpu.current_stream().record_event().synchronize(),
        "Event.synchronize",
    ),
    "Stream.synchronize": (lambda x: simgpu.Stream().synchronize(), "Stream.synchronize"),
    "synchronize": (lambda x: torch.simgpu.synchronize(), "synchronize"),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_syncs_are_logged(name: str) -> None:
    call, op = SYNCS[name]
    x = to_device(torch.arange(1.0, 5.0))
    call(x)
    assert ops() == [op]
    (event,) = LOG.events
    assert event.thread == "MainThread" and event.where == simgpu.OUTSIDE
    assert any("test_simgpu.py" in frame for frame in event.stack)


NOT_SYNCS: dict[str, Callable[[torch.Tensor], object]] = {
    "clone": lambda x: x.clone(),
    "matmul": lambda x: x.view(2, 2) @ x.view(2, 2),
    "copy_ non_blocking": lambda x: _host().copy_(x, non_blocking=True),
    "to cpu non_blocking": lambda x: x.to("cpu", non_blocking=True),
    "h2d non_blocking": lambda x: x.copy_(torch.zeros(4), non_blocking=True),
    "Event.query": lambda x: simgpu.current_stream().record_event().query(),
    "Stream.query": lambda x: simgpu.current_stream().query(),
    "wait_event": lambda x: simgpu.Stream().wait_event(simgpu.Event()),
    "zeros on device": lambda x: torch.zeros(3, device=DEVICE),
    "reduction": lambda x: (x.sum(), x.max(), x.softmax(0)),
    "uint8 view": lambda x: x.view(torch.uint8).clone(),
}


@pytest.mark.parametrize("name", list(NOT_SYNCS))
def test_device_work_is_not_logged(name: str) -> None:
    x = to_device(torch.arange(1.0, 5.0))
    NOT_SYNCS[name](x)
    assert ops() == []


def test_log_names_the_thread_and_skips_vartrace_threads() -> None:
    x = to_device(torch.ones(2))
    for name in ("worker-7", "vartrace-staging-1"):
        thread = threading.Thread(target=lambda: x.sum().item(), name=name)
        thread.start()
        thread.join()
    assert [e.thread for e in LOG.events] == ["worker-7", "vartrace-staging-1"]
    assert [e.thread for e in LOG.syncs()] == ["worker-7"]
    assert len(LOG.syncs(exclude_threads_prefix=None)) == 2


@pytest.mark.skipif(simgpu.VARTRACE_DIR is None, reason="vartrace is not importable")
def test_log_names_the_innermost_vartrace_frame() -> None:
    # A function whose code claims to live in vartrace's package folder.
    source = "def outer(x):\n    return inner(x)\n\ndef inner(x):\n    return x.sum().item()\n"
    path = os.path.join(simgpu.VARTRACE_DIR, "engine", "_simgpu_probe.py")
    namespace: dict[str, object] = {}
    exec(compile(source, path, "exec"), namespace)
    namespace["outer"](to_device(torch.ones(2)))
    (event,) = LOG.events
    assert event.where == "engine/_simgpu_probe.py:5 inner"
    assert event.stack == ("engine/_simgpu_probe.py:2 outer", "engine/_simgpu_probe.py:5 inner")


def test_paused_is_per_thread() -> None:
    x = to_device(torch.ones(2))
    with LOG.paused():
        x.sum().item()
        thread = threading.Thread(target=lambda: x.sum().item(), name="other")
        thread.start()
        thread.join()
    x.sum().item()
    assert [e.thread for e in LOG.events] == ["other", "MainThread"]


# -- asynchronous copies -----------------------------------------------------------------------


def test_deferred_copy_is_poisoned_until_it_lands() -> None:
    x = to_device(torch.arange(1.0, 5.0))
    host = torch.zeros(4)
    with simgpu.copy_delay(SLOW):
        host.copy_(x, non_blocking=True)
        done = simgpu.current_stream().record_event()
        assert poisoned(host) and torch.isnan(host).all()
        assert not done.query() and not simgpu.current_stream().query()
        done.synchronize()
    assert done.query()
    assert torch.equal(host, torch.arange(1.0, 5.0))
    assert ops() == ["Event.synchronize"]


def test_to_cpu_non_blocking_is_deferred_and_converts() -> None:
    x = to_device(torch.arange(6, dtype=torch.int32).view(2, 3).t())
    with simgpu.copy_delay(SLOW):
        host = x.to("cpu", torch.int64, non_blocking=True)
        assert host.dtype == torch.int64 and host.shape == (3, 2)
        assert (host == -1).all()  # 0xFF bytes
        simgpu.current_stream().synchronize()
    assert torch.equal(host, torch.arange(6).view(2, 3).t())


def test_never_recorded_event_is_complete() -> None:
    event = simgpu.Event()
    assert event.query()
    event.synchronize()


def test_source_is_read_when_the_copy_lands() -> None:
    x = to_device(torch.zeros(4))
    snapshot = x.clone()  # what a stager should copy from
    live, staged = torch.empty(4), torch.empty(4)
    with simgpu.copy_delay(SLOW):
        live.copy_(x, non_blocking=True)
        staged.copy_(snapshot, non_blocking=True)
        x.add_(1)  # the step goes on and writes the tensor in place
        simgpu.current_stream().synchronize()
    assert torch.equal(live, torch.ones(4))  # the late write got in: wrong data
    assert torch.equal(staged, torch.zeros(4))


def test_copies_on_one_stream_land_in_order() -> None:
    x = to_device(torch.ones(2))
    first, second = torch.empty(2), torch.empty(2)
    with simgpu.copy_delay(SLOW):
        first.copy_(x, non_blocking=True)
    done_first = simgpu.current_stream().record_event()
    with simgpu.copy_delay(0):
        second.copy_(x, non_blocking=True)
    done_second = simgpu.current_stream().record_event()
    done_second.synchronize()
    assert done_first.query() and not poisoned(first)


@pytest.mark.parametrize("ordered", [True, False])
def test_wait_event_orders_copies_across_streams(ordered: bool) -> None:
    x = to_device(torch.ones(2))
    slow, side = simgpu.Stream(), simgpu.Stream()
    early, late = torch.empty(2), torch.empty(2)
    with simgpu.stream(slow), simgpu.copy_delay(SLOW):
        early.copy_(x, non_blocking=True)
        ready = slow.record_event()
    with simgpu.stream(side), simgpu.copy_delay(0):
        if ordered:
            side.wait_event(ready)
        late.copy_(x, non_blocking=True)
        done = side.record_event()
    done.synchronize()
    # Without the wait the later copy overtakes: the check below can fail.
    assert ready.query() is ordered
    assert not poisoned(late)
    ready.synchronize()


def test_blocking_copy_waits_for_the_current_stream() -> None:
    x = to_device(torch.ones(2))
    host = torch.empty(2)
    with simgpu.copy_delay(SLOW):
        host.copy_(x, non_blocking=True)
        x.cpu()  # cudaMemcpy + cudaStreamSynchronize(current stream)
    assert simgpu.current_stream().query() and torch.equal(host, torch.ones(2))
    assert ops() == ["d2h aten._to_copy.default"]


def test_copy_shape_errors_raise_when_issued() -> None:
    with pytest.raises(RuntimeError):
        torch.empty(3).copy_(to_device(torch.ones(2, 2)), non_blocking=True)


def test_current_stream_is_per_thread() -> None:
    side = simgpu.Stream()
    seen: list[simgpu.Stream] = []
    with simgpu.stream(side):
        assert simgpu.current_stream() is side
        thread = threading.Thread(target=lambda: seen.append(simgpu.current_stream()))
        thread.start()
        thread.join()
    assert seen == [simgpu.default_stream()]
    assert simgpu.current_stream() is simgpu.default_stream()


def test_capturing_is_per_thread_and_refuses_syncs() -> None:
    x = to_device(torch.ones(2))
    seen: list[bool] = []
    assert not simgpu.is_current_stream_capturing()
    with simgpu.capturing():
        assert torch.simgpu.is_current_stream_capturing()
        thread = threading.Thread(target=lambda: seen.append(simgpu.is_current_stream_capturing()))
        thread.start()
        thread.join()
        x.clone().mul_(2)  # device work is fine
        with pytest.raises(RuntimeError, match="capturing"):
            x.sum().item()
        with pytest.raises(RuntimeError, match="capturing"):
            torch.empty(2).copy_(x, non_blocking=True)
    assert seen == [False]
    assert not simgpu.is_current_stream_capturing()


# -- autograd and whole models -----------------------------------------------------------------


def test_backward_runs_on_an_autograd_device_thread() -> None:
    w = to_device(torch.randn(3, requires_grad=True))
    threads: list[threading.Thread] = []
    y = w * 2
    y.register_hook(lambda grad: threads.append(threading.current_thread()))
    y.sum().backward()
    assert threads and threads[0] is not threading.main_thread()
    assert w.grad is not None and w.grad.device == DEVICE
    assert torch.equal(peek(w.grad), torch.full((3,), 2.0))


class GPT(nn.Module):
    """A small GPT: embeddings, pre-LayerNorm causal attention, GELU MLP, tied-free head."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, context: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.ln1, self.ln2, self.ln = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(context, context, dtype=torch.bool)))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        attn = scores.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, -1))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _gpt_loss(model: nn.Module, step: int, on_device: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    idx, targets = torch.randint(0, 32, (2, 2, 8), generator=generator)
    if on_device:
        idx, targets = to_device(idx), to_device(targets)
    return model(idx, targets)


def _tiny_loss(model: nn.Module, step: int, on_device: bool) -> torch.Tensor:
    batch = tokens(step)
    out = model(to_device(batch) if on_device else batch)
    return out.logits.logsumexp(-1).mean() + out.extras["mean"]


@pytest.mark.parametrize(
    ("make", "loss_of"), [(TinyTransformer, _tiny_loss), (GPT, _gpt_loss)], ids=["tiny", "gpt"]
)
def test_models_train_as_on_cpu(
    make: Callable[[], nn.Module], loss_of: Callable[[nn.Module, int, bool], torch.Tensor]
) -> None:
    torch.manual_seed(0)
    on_cpu = make()
    initial = copy.deepcopy(on_cpu)
    on_device = simgpu.to_device_module(copy.deepcopy(on_cpu))
    assert not torch.__future__.get_swap_module_params_on_conversion()
    assert all(p.device == DEVICE for p in on_device.parameters())
    losses = {}
    for model, device in ((on_cpu, False), (on_device, True)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        losses[device] = []
        for step in range(3):
            loss = loss_of(model, step, device)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[device].append(loss.detach())
    assert LOG.syncs() == [], LOG.summary()  # a training step needs no sync
    for device_loss, cpu_loss in zip(losses[True], losses[False], strict=True):
        torch.testing.assert_close(peek(device_loss), cpu_loss)
    for device_param, cpu_param in zip(on_device.parameters(), on_cpu.parameters(), strict=True):
        assert device_param.device == DEVICE
        torch.testing.assert_close(peek(device_param), cpu_param)
    assert not torch.equal(peek(on_device.head.weight), initial.head.weight)  # it trained

"""Paths on real diffusers code: a tiny UNet2DConditionModel trained one DDPM step, built
from a config with random weights (no downloads).

The diffusers tests are skipped where diffusers is not installed; the first test runs the
code shape that broke there (an attention whose `forward` returns what a processor object
computes) in a model of our own, so it runs everywhere.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from tests._models import TinyTransformer, tokens
from vartrace import H5PYSaverCallback, ModelTracer
from vartrace.statistics.fields import SUMMARY_FIELDS

_ATTN1 = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"


class _Processor:
    """Computes an attention for the module it is given, as diffusers' processors do."""

    def __call__(self, attn: _Attention, hidden_states: torch.Tensor) -> torch.Tensor:
        return attn.to_q(hidden_states).softmax(-1)


class _Attention(nn.Module):
    """Returns what its processor (an object, not a module) computes: keys unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(4, 4)
        self.processor = _Processor()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.processor(self, hidden_states)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn1 = _Attention()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.attn1(hidden_states) + hidden_states


def test_star_star_naming_a_method_argument_does_not_check_keys_of_its_return() -> None:
    model = nn.Sequential(_Block(), _Block())
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["**.attn1.forward.hidden_states"]) as tracer:
            model(x)
    assert sorted(tracer.results) == [
        "0.attn1.forward.hidden_states",
        "1.attn1.forward.hidden_states",
    ]
    torch.testing.assert_close(tracer.results["0.attn1.forward.hidden_states"].values[0], x)


def test_what_only_a_wildcard_reached_records_no_gradient_quietly() -> None:
    # diffusers' UNet under `**@grad`: helpers returning None, an int, a bool warned.
    model = TinyTransformer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["**@grad"]) as tracer:
            model(tokens(0)).logits.sum().backward()
    assert "forward.logits@grad" in tracer.results
    torch.testing.assert_close(tracer.results["head.weight@grad"].values[0], model.head.weight.grad)
    # Named, the int in the output's extras still warns.
    message = r"no gradient is recorded for forward\.extras\.pair\.second@grad: it holds a int"
    named = ["**@grad", "forward.extras.pair.second@grad"]
    with pytest.warns(UserWarning, match=message), ModelTracer(model, named):
        model(tokens(0))


# -- diffusers ---------------------------------------------------------------------------------


def _unet(attention_processor: bool) -> nn.Module:
    """A two-level UNet2DConditionModel (8 and 16 channels), seeded weights; with
    `attention_processor`, diffusers' `AttnProcessor`, which computes the attention
    probabilities in `Attention.get_attention_scores` (the default one calls SDPA)."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import AttnProcessor

    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        cross_attention_dim=8,
        attention_head_dim=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    ).train()
    if attention_processor:
        unet.set_attn_processor(AttnProcessor())
    return unet


def _ddpm_step(unet: nn.Module, seed: int) -> torch.Tensor:
    """One DDPM training step: noise a latent at random timesteps, predict the noise,
    backward the MSE; returns the prediction."""
    from diffusers import DDPMScheduler

    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    noise = torch.randn(latents.shape, generator=generator)
    timesteps = torch.randint(0, 10, (2,), generator=generator)
    text = torch.randn(2, 3, 8, generator=generator)
    noisy = DDPMScheduler(num_train_timesteps=10).add_noise(latents, noise, timesteps)
    prediction = unet(noisy, timesteps, text).sample
    torch.nn.functional.mse_loss(prediction, noise).backward()
    return prediction.detach()


def test_unet_training_step_records_blocks_attention_probabilities_and_gradients() -> None:
    unet = _unet(attention_processor=True)
    probabilities = f"{_ATTN1}.get_attention_scores.attention_probs"
    assert probabilities in vartrace.list_sites(unet, f"{_ATTN1}.**")
    outputs: dict[str, torch.Tensor] = {}
    for name in ("down_blocks.0.resnets.0", "down_blocks.1.resnets.0"):
        unet.get_submodule(name).register_forward_hook(
            lambda _m, _a, out, name=name: outputs.setdefault(name, out.detach().clone())
        )
    patterns = [
        "down_blocks.*.resnets.*.forward",
        "**.attn1.get_attention_scores.attention_probs",
        "**.attn1.forward.hidden_states",
        "conv_out.weight@grad",
        "forward.sample@return",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(unet, patterns) as tracer:
            prediction = _ddpm_step(unet, seed=1)
    results = tracer.results
    for name, output in outputs.items():
        torch.testing.assert_close(results[f"{name}.forward"].values[0], output)
    torch.testing.assert_close(results["forward.sample"].values[0], prediction)
    torch.testing.assert_close(results["conv_out.weight@grad"].values[0], unet.conv_out.weight.grad)
    layers = ["down_blocks.0.attentions.0", "mid_block.attentions.0"]
    layers += [f"up_blocks.1.attentions.{i}" for i in (0, 1)]
    for layer in layers:
        attn = unet.get_submodule(f"{layer}.transformer_blocks.0.attn1")
        site = f"{layer}.transformer_blocks.0.attn1"
        hidden = results[f"{site}.forward.hidden_states"].values[0]
        query = attn.head_to_batch_dim(attn.to_q(hidden))
        key = attn.head_to_batch_dim(attn.to_k(hidden))
        expected = attn.get_attention_scores(query, key).detach()
        torch.testing.assert_close(
            results[f"{site}.get_attention_scores.attention_probs"].values[0], expected
        )


def test_unet_with_the_default_sdpa_processor_says_why_attention_probs_are_missing() -> None:
    unet = _unet(attention_processor=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(unet, ["**.attention_probs"]):
            _ddpm_step(unet, seed=1)
    said = [str(w.message) for w in caught]
    assert len(said) == 2, said
    assert "'**.attention_probs' recorded nothing in iteration 1: its method was not" in said[0]
    assert f"recorded nothing: its method was never called ({_ATTN1}.get" in said[1]


def _run(unet: nn.Module, path: Path, seed: int, **tracer: Any) -> None:
    patterns = ["down_blocks.*.resnets.*.forward", "**.attention_probs", "forward.sample@return"]
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(unet, patterns, post_gather_callbacks=[saver], **tracer),
    ):
        _ddpm_step(unet, seed)


def test_unet_runs_round_trip_through_files_and_compare(tmp_path: Path) -> None:
    unet = _unet(attention_processor=True)
    state = {k: v.clone() for k, v in unet.state_dict().items()}
    first, second, other = tmp_path / "a.h5", tmp_path / "b.h5", tmp_path / "c.h5"
    _run(unet, first, seed=1)
    with ModelTracer(unet, ["forward.sample@return"]) as tracer:
        unet.load_state_dict(state)
        _ddpm_step(unet, seed=1)
    for path, seed in ((second, 1), (other, 2)):
        unet.load_state_dict(state)
        _run(unet, path, seed)
    with vartrace.open(first) as run:
        assert f"{_ATTN1}.get_attention_scores.attention_probs" in run
        assert len([name for name in run if name.endswith("attention_probs")]) == 8
        torch.testing.assert_close(
            torch.as_tensor(run["forward.sample"].get(iteration=1)),
            tracer.results["forward.sample"].values[0],
        )
    cli = [sys.executable, "-m", "vartrace", "compare"]
    same = subprocess.run([*cli, str(first), str(second)], capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    differs = subprocess.run([*cli, str(first), str(other)], capture_output=True, text=True)
    assert differs.returncode == 1, differs.stdout + differs.stderr
    assert "forward.sample" in differs.stdout


def test_unet_statistics_rows_summarise_the_recorded_values() -> None:
    unet = _unet(attention_processor=True)
    site = "down_blocks.0.resnets.0.forward"
    seen: list[torch.Tensor] = []
    unet.get_submodule("down_blocks.0.resnets.0").register_forward_hook(
        lambda _m, _a, out: seen.append(out.detach().clone())
    )
    with ModelTracer(unet, [site, "**.attention_probs"], statistics=True) as tracer:
        _ddpm_step(unet, seed=1)
    # A record is a header, then the SUMMARY_FIELDS.
    row = dict(zip(SUMMARY_FIELDS, tracer.results[site].values[0][1:].tolist(), strict=True))
    (value,) = seen
    assert row["count"] == value.numel()
    torch.testing.assert_close(row["mean"], value.double().mean().item())
    torch.testing.assert_close(row["max"], value.double().max().item())
    probabilities = tracer.results[f"{_ATTN1}.get_attention_scores.attention_probs"].values[0]
    assert 0.0 <= probabilities[1 + SUMMARY_FIELDS.index("min")] <= 1.0

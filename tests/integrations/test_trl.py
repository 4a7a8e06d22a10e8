"""Paths on real TRL code: its fused LM head on a tiny Llama, and one SFTTrainer run on
an in-memory dataset with a tokenizer built locally (random weights, no downloads).

Skipped where trl (or transformers, datasets) is not installed.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import vartrace
from tests._hf import tiny_llama, word_tokenizer
from vartrace import H5PYSaverCallback, ModelTracer

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

# transformers 5 renames gradient checkpointing, which TRL's trainers still call by its old names.
pytestmark = pytest.mark.filterwarnings("ignore:`(is_)?gradient_checkpointing:FutureWarning")

_WEIGHTS = "model.layers.{}.self_attn.forward>eager_attention_forward.attn_weights"


def _fused_llama() -> torch.nn.Module:
    """A tiny Llama whose forward TRL replaced by its fused LM head, as its trainers do."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_llama(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def _ids() -> torch.Tensor:
    return torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(0))


def test_fused_lm_head_outputs_attention_and_lm_head_gradient() -> None:
    model = _fused_llama()
    # Keys of TRL's FusedCausalLMOutput, not of the class's forward: checked at the return.
    patterns = [
        "forward.loss",
        "forward.log_probs",
        "model.layers.*.self_attn.forward>eager_attention_forward.attn_weights",
        "forward.self.lm_head.weight@grad",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, patterns) as tracer:
            out = model(input_ids=_ids(), labels=_ids(), fused_lm_head=True)
            out.loss.backward()
    results = tracer.results
    torch.testing.assert_close(results["forward.loss"].values[0], out.loss.detach())
    torch.testing.assert_close(results["forward.log_probs"].values[0], out.log_probs.detach())
    weight_grad = results["forward.self.lm_head.weight@grad"].values[0]
    torch.testing.assert_close(weight_grad, model.lm_head.weight.grad)
    for layer in (0, 1):
        weights = results[_WEIGHTS.format(layer)].values[0]
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 6))


def test_a_parameter_of_a_module_the_fused_head_never_calls_names_the_way_to_it() -> None:
    model = _fused_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, ["lm_head.weight@grad"]):
            model(input_ids=_ids(), labels=_ids(), fused_lm_head=True).loss.backward()
    said = [str(w.message) for w in caught]
    assert any(
        "its method was never called (lm_head.forward)" in text
        and "name it through the model's forward instead: 'forward.self.lm_head.weight@grad'"
        in text
        for text in said
    ), said


def test_a_local_of_the_fused_forward_names_the_function_that_replaced_forward() -> None:
    model = _fused_llama()
    message = (
        r"'forward\.hidden_states' recorded nothing: <root>\.forward is the function "
        r"add_fused_lm_head\.<locals>\._fused_forward \(.*trl.*\), set on the module before"
    )
    with pytest.warns(UserWarning, match=message), ModelTracer(model, ["forward.hidden_states"]):
        model(input_ids=_ids(), labels=_ids(), fused_lm_head=True)


def _two_steps(tmp_path: Path) -> dict[str, Any]:
    """A trainer configuration of two logged steps of two examples on the CPU, saving nothing."""
    return {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
    }


def test_sft_trainer_run_is_recorded_into_a_file(tmp_path: Path) -> None:
    texts = [" ".join(f"w{(7 * i + j) % 29}" for j in range(5 + i)) for i in range(4)]
    config = trl.SFTConfig(**_two_steps(tmp_path))
    model = tiny_llama(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=word_tokenizer(),
    )
    path = tmp_path / "run.h5"
    patterns = ["forward.loss", "forward.input_ids", "**.attn_weights"]
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(trainer.model, patterns, post_gather_callbacks=[saver]),
    ):
        trainer.train()
    # SFTConfig checkpoints activations: the recomputed forward records nothing twice.
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    with vartrace.open(path) as run:
        assert run["forward.loss"].iterations.tolist() == [1, 2]
        assert run["forward.loss"].values[:].tolist() == pytest.approx(losses)
        for layer in (0, 1):
            weights = run[_WEIGHTS.format(layer)]
            assert weights.iterations.tolist() == [1, 2]
            assert run.aliases[f"model.layers.{layer}.self_attn.forward.attn_weights"] == (
                _WEIGHTS.format(layer)
            )
            probabilities = torch.as_tensor(weights.get(iteration=1))
            torch.testing.assert_close(probabilities.sum(-1), torch.ones(probabilities.shape[:-1]))


def test_dpo_trainer_log_probs_give_the_logged_chosen_and_rejected_log_probs(
    tmp_path: Path,
) -> None:
    prompts = [f"w{i} w{i + 1}" for i in range(4)]
    data = datasets.Dataset.from_dict(
        {
            "prompt": prompts,
            "chosen": [f" w{i + 2} w{i + 3}" for i in range(4)],
            "rejected": [f" w{i + 5}" for i in range(4)],
        }
    )
    config = trl.DPOConfig(**_two_steps(tmp_path))
    ids = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    trainer = trl.DPOTrainer(
        model=tiny_llama(**ids),
        ref_model=tiny_llama(**ids),
        args=config,
        train_dataset=data,
        processing_class=word_tokenizer(),
    )
    with ModelTracer(trainer.model, ["forward"]) as tracer:
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "logps/chosen" in entry]
    log_probs = tracer.results["forward.log_probs"]
    assert list(log_probs.iterations) == [1, 2]
    # One forward a step on [chosen, rejected]: a row's log-probability is its sum.
    for entry, value in zip(logged, log_probs.values, strict=True):
        chosen, rejected = value.sum(1).chunk(2)
        assert entry["logps/chosen"] == pytest.approx(chosen.mean().item(), rel=1e-5)
        assert entry["logps/rejected"] == pytest.approx(rejected.mean().item(), rel=1e-5)

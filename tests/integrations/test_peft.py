"""Paths on a real PEFT model (issue 22, item 13), built from a tiny config without downloads.

Skipped where peft or transformers is not installed; tests/integrations/test_hf_shapes.py covers
the same code shapes (``PeftLike``, ``GetterWrapper``) with models of our own.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests._hf import tiny_llama
from vartrace import ModelTracer

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _lora_llama() -> torch.nn.Module:
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(tiny_llama(), lora)


def test_peft_causal_lm_output_keys_are_sites() -> None:
    model = _lora_llama()
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["forward.loss", "forward.logits"]) as tracer:
            out = model(input_ids=ids, labels=ids)
    assert sorted(tracer.results) == ["forward.logits", "forward.loss"]
    torch.testing.assert_close(tracer.results["forward.loss"].values[0], out.loss.detach())
    # One of PeftModelForCausalLM's returns goes through a local's method: the run tells.
    message = r"'forward\.lgoits': forward returned a CausalLMOutputWithPast.*closest: logits"
    with pytest.warns(UserWarning, match=message), ModelTracer(model, ["forward.lgoits"]):
        model(input_ids=ids)

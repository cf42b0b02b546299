"""shifu.lora: the actor with adapters disabled *is* the frozen reference, before and after training."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from shifu import distributed as D  # noqa: E402
from shifu import lora  # noqa: E402
from shifu.errors import ConfigError, ShifuError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist_scripts"))
import tiny  # noqa: E402

torch.set_num_threads(1)


def ref_log_probs(model, b) -> torch.Tensor:
    """(B, T-1) log-prob of each next token (what PPO's reference pass computes)."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)


@pytest.fixture()
def setup():
    tok = tiny.char_tokenizer()
    base = tiny.tiny_model(tok).eval()
    frozen = copy.deepcopy(base).requires_grad_(False)  # the real reference a non-LoRA run would load
    actor = lora.wrap_lora(base, lora.LoraConfig(enabled=True, r=4, alpha=8.0))
    return tok, frozen, actor, tiny.batch(tok, tiny.TEXTS)


def test_reference_is_the_actor_without_adapters_before_and_after_training(setup, tmp_path):
    tok, frozen, actor, b = setup
    with torch.no_grad():
        want = ref_log_probs(frozen, b)
        with lora.reference(actor, None) as ref:
            before = ref_log_probs(ref, b)
    assert torch.equal(before, want)

    # a few SGD steps on the adapters only (B starts at 0, so the first step only moves B)
    opt = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=1.0)
    for _ in range(3):
        s, n = tiny.nll_sum_and_count(actor, b)
        (s / n).backward()
        with_grad = {k for k, p in actor.named_parameters() if p.grad is not None}
        assert with_grad and all("lora_" in k for k in with_grad), "only adapter parameters get gradients"
        opt.step()
        opt.zero_grad()

    with torch.no_grad():
        trained = ref_log_probs(actor, b)
        with lora.reference(actor, None) as ref:
            after = ref_log_probs(ref, b)
        again = ref_log_probs(actor, b)  # adapters are back on after the block
    assert (trained - want).abs().max() > 1e-2, "the adapters should have changed the policy"
    assert torch.equal(after, want), f"reference drifted by {(after - want).abs().max():.2e}"
    assert torch.equal(again, trained)

    # the merged model is a plain HF directory that computes the trained policy
    merged = lora.merged_copy(actor)
    merged.save_pretrained(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(ref_log_probs(reloaded, b), trained, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(ref_log_probs(actor, b), trained), "merged_copy must leave the actor untouched"


def test_lora_with_gradient_checkpointing_gives_the_same_adapter_gradients(setup):
    _, _, actor, b = setup
    with torch.no_grad():  # make B non-zero so A gets a gradient too
        for k, p in actor.named_parameters():
            if "lora_B" in k:
                p.normal_(0, 0.1)
    other = copy.deepcopy(actor)
    D.enable_gradient_checkpointing(other)
    grads = []
    for m in (actor, other):
        m.train()
        s, n = tiny.nll_sum_and_count(m, b)
        (s / n).backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in k for k in grads[0])
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-6, atol=1e-7, msg=k)


def test_reference_prefers_a_given_model_and_errors_clearly():
    tok = tiny.char_tokenizer()
    plain = tiny.tiny_model(tok)
    other = torch.nn.Linear(1, 1)
    with lora.reference(plain, other) as ref:
        assert ref is other
    with pytest.raises(ShifuError, match="no reference model"), lora.reference(plain, None):
        pass
    with pytest.raises(ConfigError, match="lora.r"):
        lora.wrap_lora(plain, lora.LoraConfig(enabled=True, r=0))
    with pytest.raises(ConfigError, match="target_modules"):
        lora.wrap_lora(plain, lora.LoraConfig(enabled=True, target_modules=["no_such_layer"]))
    summary = lora.trainable_summary(lora.wrap_lora(tiny.tiny_model(tok), lora.LoraConfig(enabled=True, r=2)))
    assert summary.startswith("trainable ") and "(0.00%)" not in summary

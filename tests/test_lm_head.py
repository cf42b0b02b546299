"""The output layer applied in chunks (shifu.generation.lm_head): policy_forward's log-probs, entropies, values
and every parameter's gradient equal the HF forward's full logits, without a (B, R, V) tensor; models whose
logits are not the plain layer's output (soft-capping, a LoRA-adapted head, an unknown architecture) are
scored through their logits."""

from __future__ import annotations

import pytest
import torch
from test_rollout import EOS, PAD, left_padded_prompts, tiny_gpt2, tiny_llama, tiny_neox
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM

from shifu.generation import lm_head
from shifu.generation.rollout import policy_forward
from shifu.models.padding import position_ids_from_mask

pytestmark = pytest.mark.unit

torch.set_num_threads(1)
VOCAB = 1000  # big enough that the logits are the largest tensor of a forward


def tiny_gemma2(seed: int = 0, vocab: int = 61):
    torch.manual_seed(seed)
    cfg = Gemma2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        final_logit_softcapping=2.0,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=PAD,
    )
    return Gemma2ForCausalLM(cfg).eval()


def batch(vocab: int, R: int = 9, seed: int = 2):
    ids, mask = left_padded_prompts()
    resp = torch.randint(3, vocab, (ids.shape[0], R), generator=torch.Generator().manual_seed(seed))
    resp_mask = torch.ones_like(resp)
    resp_mask[1, 6:] = 0  # a short response: right padding
    return torch.cat([ids, resp], 1), torch.cat([mask, resp_mask], 1), ids.shape[1]


def reference(model, ids, mask, P, temperature, head=None):
    """Log-probs, entropies and values from the HF forward's whole logits (log_softmax)."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        output_hidden_states=True,
    )
    logp = torch.log_softmax(out.logits[:, P - 1 : -1].float() / temperature, -1)
    lp = logp.gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1)
    values = None if head is None else head(out.hidden_states[-1][:, P - 1 : -1]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1), values


def gradients(model, head, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)
    loss.backward()
    named = [*model.named_parameters(), *(("head." + n, p) for n, p in head.named_parameters())]
    return {n: p.grad.clone() for n, p in named if p.grad is not None}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # tied and untied output layers
@pytest.mark.parametrize("chunk_elements", [2**22, 3 * VOCAB])  # one chunk, and 3 rows a chunk
def test_chunked_output_layer_equals_the_full_logits(arch, chunk_elements, monkeypatch):
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", chunk_elements)
    model = {"gpt2": tiny_gpt2, "llama": tiny_llama}[arch](0, VOCAB)
    assert lm_head.output_layer(model) is model.lm_head
    torch.manual_seed(3)
    head = torch.nn.Linear(32, 1)
    ids, mask, P = batch(VOCAB)
    w = torch.randn(ids.shape[0], ids.shape[1] - P)
    lp, ent, values = policy_forward(model, ids, mask, P, 0.7, with_entropy=True, value_head=head)
    ref_lp, ref_ent, ref_values = reference(model, ids, mask, P, 0.7, head)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, ref_values, rtol=1e-5, atol=1e-5)
    got = gradients(model, head, (lp * w).sum() + (ent * w).sum() + values.sum())
    want = gradients(model, head, (ref_lp * w).sum() + (ref_ent * w).sum() + ref_values.sum())
    assert got.keys() == want.keys() and "head.weight" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk_elements", [2**22, 5 * VOCAB])
def test_sequence_log_probs_are_the_plain_forwards(chunk_elements, monkeypatch):
    """The SFT and ptx losses' log-probs: every token after the first under the model's own positions,
    values and gradients as through the whole logits."""
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", chunk_elements)
    model = tiny_gpt2(0, VOCAB)
    ids = torch.randint(3, VOCAB, (3, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    w = torch.randn(3, 11)
    lp = lm_head.sequence_log_probs(model, ids, mask)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1], -1)
    ref = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    head = torch.nn.Linear(1, 1)  # (no value head here)
    got, want = gradients(model, head, (lp * w).sum()), gradients(model, head, (ref * w).sum())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


class Largest(TorchDispatchMode):
    """The largest op output seen."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_vocabulary_wide_tensor_in_the_forward_or_backward(monkeypatch):
    """With a small chunk, no op output of the loss's forward and backward is as large as the (B, R, V)
    logits (the largest is the output layer's weight or its gradient); the full-logits path makes one."""
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 4 * VOCAB)
    model = tiny_gpt2(0, VOCAB).train()
    ids, mask, P = batch(VOCAB, R=20)
    logits_numel = ids.shape[0] * (ids.shape[1] - P) * VOCAB
    sizes = {}
    for name, types in (("chunked", lm_head.PLAIN_OUTPUT_LAYER), ("logits", frozenset())):
        monkeypatch.setattr(lm_head, "PLAIN_OUTPUT_LAYER", types)
        mode = Largest()
        with mode:
            lp, ent, _ = policy_forward(model, ids, mask, P, 0.7, with_entropy=True)
            (lp.sum() + ent.sum()).backward()
        sizes[name] = mode.numel
    assert sizes["chunked"] == model.lm_head.weight.numel() < logits_numel
    assert sizes["logits"] >= logits_numel


def test_models_whose_logits_are_not_the_plain_layer_are_scored_through_their_logits():
    """Gemma 2 soft-caps its logits after the layer; GPT-NeoX is not in the list: both take the full-logits
    forward, and the soft-capped log-probs are the model's (the layer alone would give others)."""
    for model in (tiny_gemma2(), tiny_neox()):
        assert lm_head.output_layer(model) is None
        ids, mask, P = batch(model.config.vocab_size)
        with torch.no_grad():
            lp, ent, _ = policy_forward(model, ids, mask, P, 0.7, with_entropy=True)
            ref_lp, ref_ent, _ = reference(model, ids, mask, P, 0.7)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    gemma = tiny_gemma2()
    with torch.no_grad():
        hidden = lm_head.head_input(
            gemma, gemma.lm_head, torch.arange(P - 1, ids.shape[1] - 1), input_ids=ids
        )
        uncapped = torch.log_softmax(gemma.lm_head(hidden) / 0.7, -1)
    assert (uncapped.gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1) - ref_lp).abs().max() > 0.1


def test_lora_actor_keeps_the_chunked_layer_unless_the_layer_is_adapted():
    """A LoRA actor whose adapters sit in the blocks reads its frozen output layer in chunks (no gradient
    for it); adapters on the output layer itself make it a peft module: full logits."""
    peft = pytest.importorskip("peft")
    ids, mask, P = batch(VOCAB)
    blocks = peft.get_peft_model(
        tiny_llama(0, VOCAB), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    assert lm_head.output_layer(blocks) is blocks.get_base_model().lm_head
    lp = policy_forward(blocks, ids, mask, P, 0.7)[0]
    torch.testing.assert_close(lp, reference(blocks, ids, mask, P, 0.7)[0], rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    assert blocks.get_base_model().lm_head.weight.grad is None
    adapted = peft.get_peft_model(tiny_llama(0, VOCAB), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    assert lm_head.output_layer(adapted) is None
    lp = policy_forward(adapted, ids, mask, P, 0.7)[0]
    torch.testing.assert_close(lp, reference(adapted, ids, mask, P, 0.7)[0], rtol=1e-5, atol=1e-5)


def test_exact_kl_takes_the_whole_distribution():
    """log_softmax=True (kl.loss_estimator=full) returns the (B, R, V) log-distribution as before."""
    model = tiny_gpt2(0, VOCAB)
    ids, mask, P = batch(VOCAB)
    with torch.no_grad():
        lp, _, _, full = policy_forward(model, ids, mask, P, 0.7, log_softmax=True)
    assert full.shape == (ids.shape[0], ids.shape[1] - P, VOCAB)
    torch.testing.assert_close(full.gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1), lp)

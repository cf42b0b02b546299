"""shifu.models.lora: the actor with adapters disabled *is* the frozen reference, before and after training."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from shifu.errors import ConfigError, ShifuError  # noqa: E402
from shifu.models import lora  # noqa: E402
from shifu.parallel.strategy import enable_gradient_checkpointing  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist_scripts"))
import tiny  # noqa: E402

pytestmark = pytest.mark.unit

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
    enable_gradient_checkpointing(other)
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


def test_lora_critic_starts_equal_trains_adapters_and_head_and_merges_into_a_plain_critic(tmp_path):
    from shifu.models.scalar import ScalarModel

    tok = tiny.char_tokenizer()
    b = tiny.batch(tok, tiny.TEXTS)
    critic = ScalarModel(tiny.tiny_model(tok).transformer, tok, seed=0)
    with torch.no_grad():
        before = critic(b["input_ids"], b["attention_mask"])
    lora.wrap_lora_critic(critic, lora.LoraConfig(enabled=True, r=4, alpha=8.0))
    assert lora.is_lora_critic(critic) and not lora.is_lora(critic)
    with torch.no_grad():
        assert torch.equal(critic(b["input_ids"], b["attention_mask"]), before)  # B = 0: same values
    trainable = {k for k, p in critic.named_parameters() if p.requires_grad}
    assert {"head.weight", "head.bias"} <= trainable
    assert all("lora_" in k or k.startswith("head.") for k in trainable)
    opt = torch.optim.SGD([p for p in critic.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        (critic(b["input_ids"], b["attention_mask"]) - 1.0).pow(2).mean().backward()
        opt.step(), opt.zero_grad()
    with torch.no_grad():
        trained = critic(b["input_ids"], b["attention_mask"])
    assert (trained - before).abs().max() > 1e-2
    merged = lora.merged_copy(critic)
    assert not lora.is_lora_critic(merged) and lora.is_lora_critic(critic)  # the critic keeps its adapters
    merged.save_pretrained(tmp_path / "critic")
    reloaded = ScalarModel.from_pretrained(tmp_path / "critic").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(b["input_ids"], b["attention_mask"]), trained, rtol=1e-5, atol=1e-5
        )


def test_checkpoint_of_lora_modules_holds_only_what_trains_and_restores_it_exactly(tmp_path):
    from safetensors import safe_open

    from shifu.runs import checkpoint as ckpt

    tok = tiny.char_tokenizer()
    cfg = lora.LoraConfig(enabled=True, r=4, alpha=8.0)

    def fresh(seed):
        torch.manual_seed(seed)  # a different adapter initialisation each time
        return lora.wrap_lora(tiny.tiny_model(tok), cfg)

    actor = fresh(1)
    with torch.no_grad():
        for k, p in actor.named_parameters():
            if "lora_B" in k:
                p.normal_(0, 0.1)  # "trained" adapters
    path = ckpt.save_checkpoint(tmp_path, 3, {"actor": actor}, {}, {})
    with safe_open(str(path / "model-actor.safetensors"), "pt") as st:
        keys = list(st.keys())
    assert keys and all("lora_" in k for k in keys)
    base_bytes = sum(p.numel() * 4 for k, p in actor.named_parameters() if "lora_" not in k)
    assert (path / "model-actor.safetensors").stat().st_size < base_bytes / 5
    other = fresh(2)
    ckpt.load_checkpoint(path, {"actor": other})
    for (k, p), (_, q) in zip(actor.state_dict().items(), other.state_dict().items()):
        assert torch.equal(p, q), k
    # a checkpoint missing a trained tensor is refused (frozen ones may be absent, trained ones not)
    plain = tiny.tiny_model(tok)  # every parameter trains: it must all be there
    with pytest.raises(ShifuError, match="does not match"):
        ckpt.load_checkpoint(path, {"actor": plain})
    full = ckpt.save_checkpoint(tmp_path / "full", 1, {"actor": tiny.tiny_model(tok)}, {}, {})
    with safe_open(str(full / "model-actor.safetensors"), "pt") as st:
        assert not any("lora_" in k for k in st.keys()) and len(list(st.keys())) > 10


def test_lora_critic_is_refused_where_there_is_no_critic_of_its_own():
    from shifu.config.loader import load_config
    from shifu.config.schema import PPOConfig

    base = ["out_dir=x", "model.path=m", "data.train=p.jsonl", "reward.function=a:b", "lora.critic=true"]
    cfg = load_config(PPOConfig, None, [*base, "critic.init=sft"])
    assert cfg.lora.critic and not cfg.lora.enabled  # a LoRA critic next to a fully trained actor is allowed
    for extra in (
        ["critic.init=shared"],
        ["algo=reinforce", "ppo_epochs=1"],
        ["lora.r=0", "critic.init=sft"],
    ):
        with pytest.raises(ConfigError, match="lora"):
            load_config(PPOConfig, None, [*base, *extra])


def sampled_by_both_engines(actor, ids, mask, params, tok):
    """One call sampled (seed 1) through shifu's decoder (engine auto), then through the HF forward (engine hf)."""
    from shifu.generation.rollout import sample

    args = (params, tok.eos_token_id, tok.pad_token_id)
    return tuple(
        sample(actor, ids, mask, *args, torch.Generator().manual_seed(1), with_log_probs=True, engine=engine)
        for engine in ("auto", "hf")
    )


def test_a_lora_actor_samples_from_its_adapted_policy(setup):
    """Rollouts of a LoRA actor come from the adapted policy, not the base model: the hand-written GPT-2
    decoder reads each adapted layer's weight with its adapters merged in (W + s B A), so a peft model
    decodes fast, with the tokens the HF forward of the adapted model samples and log-probs equal to the
    adapted actor's full forward at the sampled tokens (and unlike the base model's). Adapters a merge does
    not express (here: on the embedding) decode through the HF forward, and engine 'fast' says so."""
    from shifu.generation.decode import _GPT2Decoder, _HFDecoder, decoder, keeps_kv
    from shifu.generation.rollout import SamplingParams, policy_forward
    from shifu.models.padding import pad_left

    tok, frozen, actor, _ = setup
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    enc = pad_left(
        [tok(t, add_special_tokens=False)["input_ids"] for t in ("abc", "ab", "cab")], tok.pad_token_id
    )
    ids, mask = enc["input_ids"], enc["attention_mask"]
    params = SamplingParams(max_new_tokens=6, stop_at_eos=False)
    w = next(frozen.parameters())
    assert isinstance(decoder(actor, 3, 9, w, "auto"), _GPT2Decoder) and keeps_kv(actor)
    with torch.no_grad():
        s, hf = sampled_by_both_engines(actor, ids, mask, params, tok)
        full = torch.cat([ids, s.response_ids], 1)
        attn = torch.cat([mask, s.response_mask.long()], 1)
        adapted = policy_forward(actor, full, attn, ids.shape[1])[0]
        base = policy_forward(frozen, full, attn, ids.shape[1])[0]
    assert torch.equal(s.response_ids, hf.response_ids), "the merged weights sample what peft's forward does"
    torch.testing.assert_close(s.log_probs, hf.log_probs, rtol=0, atol=1e-5)
    torch.testing.assert_close(s.log_probs, adapted.float(), rtol=0, atol=1e-5)
    assert (s.log_probs - base).abs().max() > 0.1, "the adapters should change the sampled log-probs"

    # LoRA on the token embedding: not a merge the decoders read, so the HF forward decodes
    on_embedding = lora.wrap_lora(
        copy.deepcopy(frozen), lora.LoraConfig(enabled=True, r=4, target_modules=["wte"])
    )
    assert isinstance(decoder(on_embedding, 3, 9, w, "auto"), _HFDecoder) and not keeps_kv(on_embedding)
    with pytest.raises(ValueError, match="no fast decoder for these LoRA adapters"):
        decoder(on_embedding, 3, 9, w, "fast")


def test_a_lora_layer_reads_as_its_base_weight_and_low_rank_terms(setup):
    """lora.linear: a plain layer's own weight and bias and no adapter term; an adapted layer's base weight (the
    same tensor, never a copy) and its adapter's (A, B, alpha / r), none with the adapters switched off (the
    reference); base product plus the terms (lora.add_low_rank) is the peft layer's own output."""
    tok, frozen, actor, _ = setup
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    plain = frozen.transformer.h[0].attn.c_attn
    layer = lora.base_model(actor).transformer.h[0].attn.c_attn
    w, b, low = lora.linear(plain)
    assert w is plain.weight and b is plain.bias and low == ()
    w, b, low = lora.linear(layer)
    assert w is layer.get_base_layer().weight and len(low) == 1 and low[0][2] == 8.0 / 4
    x = torch.randn(5, w.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(
            lora.add_low_rank(torch.addmm(b, x, w), x, low), layer(x)
        )  # GPT-2's Conv1D: x W + b
    with lora.adapters_disabled(actor):
        assert lora.linear(layer)[2] == ()


def test_a_lora_llama_decodes_through_its_adapters_on_every_projection():
    """A Llama-style actor with LoRA on all seven projections (the SmolLM2 presets' layers) decodes with shifu's
    decoder: the tokens peft's HF forward samples, log-probs within 1e-5 of the adapted model's full forward,
    and unlike the base model's; through the running decode (episodes', the gateway's) as through a call."""
    from conftest import build_tiny_tokenizer
    from test_prefix_cache import tiny_llama

    from shifu.generation.continuous import Row, Running
    from shifu.generation.decode import _LlamaDecoder, decoder, keeps_kv
    from shifu.generation.rollout import SamplingParams, policy_forward

    tok = build_tiny_tokenizer()
    base = tiny_llama(tok)
    frozen = copy.deepcopy(base).requires_grad_(False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    actor = lora.wrap_lora(base, lora.LoraConfig(enabled=True, r=4, alpha=8.0, target_modules=targets)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    w = next(frozen.parameters())
    assert isinstance(decoder(actor, 2, 8, w, "auto"), _LlamaDecoder) and keeps_kv(actor)
    prompt = torch.randint(3, len(tok), (2, 7), generator=g)
    mask = torch.ones_like(prompt)
    params = SamplingParams(max_new_tokens=8, stop_at_eos=False)
    with torch.no_grad():
        fast, hf = sampled_by_both_engines(actor, prompt, mask, params, tok)
        full = torch.cat([prompt, fast.response_ids], 1)
        adapted = policy_forward(actor, full, torch.ones_like(full), 7)[0]
        plain = policy_forward(frozen, full, torch.ones_like(full), 7)[0]
        ended: list[Row] = []
        loop = Running(actor, params, tok.eos_token_id, tok.pad_token_id, ended.append)
        loop.admit([Row(prompt[0].tolist(), 8, generator=torch.Generator().manual_seed(2))])
        while loop.rows:
            loop.step()
        row = ended[0]
        ids = torch.tensor([prompt[0].tolist() + row.ids])
        running = policy_forward(actor, ids, torch.ones_like(ids), 7)[0]
    assert torch.equal(fast.response_ids, hf.response_ids)
    torch.testing.assert_close(fast.log_probs, adapted.float(), rtol=0, atol=1e-5)
    assert (fast.log_probs - plain).abs().max() > 0.1, "the adapters should change the sampled log-probs"
    torch.testing.assert_close(torch.tensor([row.log_probs]), running.float(), rtol=0, atol=1e-5)

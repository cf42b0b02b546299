"""The rollout engine against plain references: HF ``generate`` for greedy decoding, a full forward pass for
log-probs, a python loop for the EOS/padding convention, and the sampling support under top-k / top-p."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from shifu.generation.decode import decoder
from shifu.generation.rollout import (
    SamplingParams,
    critic_forward,
    generate,
    policy_forward,
    sample,
    sample_next,
)
from shifu.models.padding import position_ids_from_mask
from shifu.models.scalar import ScalarModel
from shifu.trainers.ppo_rollout import Rollout

pytestmark = pytest.mark.unit

torch.set_num_threads(1)
V, EOS, PAD = 61, 2, 0


def tiny_gpt2(seed: int = 0, vocab: int = V):
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        eos_token_id=EOS,
        bos_token_id=EOS,
        pad_token_id=PAD,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg).eval()


def tiny_llama(seed: int = 0, vocab: int = V):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_neox(seed: int = 0):
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    return GPTNeoXForCausalLM(cfg).eval()


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def left_padded_prompts(lengths=(7, 3, 5, 1), pad=PAD, seed=1):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.full((len(lengths), P), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), P), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n :] = torch.randint(3, V, (n,), generator=g)
        mask[i, P - n :] = 1
    return ids, mask


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_greedy_matches_hf_generate_on_left_padded_batch(arch, engine):
    model = MODELS[arch]()
    ids, mask = left_padded_prompts()
    params = SamplingParams(max_new_tokens=12, greedy=True, stop_at_eos=False)
    resp, resp_mask = generate(model, ids, mask, params, EOS, PAD, engine=engine)
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=12,
            pad_token_id=PAD,
            eos_token_id=None,
        )
    assert torch.equal(resp, ref[:, ids.shape[1] :])
    assert resp_mask.all()


def test_unsupported_architecture_falls_back_to_hf_forward():
    model = tiny_neox()
    ids, mask = left_padded_prompts()
    params = SamplingParams(max_new_tokens=8, greedy=True, stop_at_eos=False)
    resp, _ = generate(model, ids, mask, params, EOS, PAD)
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=8,
            min_new_tokens=8,
            pad_token_id=PAD,
            eos_token_id=None,
        )
    assert torch.equal(resp, ref[:, ids.shape[1] :])
    with pytest.raises(ValueError, match="no fast decoder"):
        generate(model, ids, mask, params, EOS, PAD, engine="fast")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fast_decoder_log_probs_equal_full_forward(arch):
    """Teacher-force the sampled tokens through the fast decoder: its per-step log-probs of the sampled
    tokens (logits / T) equal policy_forward's on the concatenated sequence, as do the entropies."""
    model, temperature = MODELS[arch](), 0.7
    ids, mask = left_padded_prompts()
    params = SamplingParams(max_new_tokens=10, temperature=temperature, stop_at_eos=False)
    resp, resp_mask = generate(model, ids, mask, params, EOS, PAD, torch.Generator().manual_seed(3))
    B, P = ids.shape
    R = resp.shape[1]
    dec = decoder(model, B, P + R, ids, "fast")
    dec.key_mask[:, :P] = mask.bool()
    pos = position_ids_from_mask(mask)
    with torch.no_grad():
        steps = [dec.forward(ids, pos)]
        for t in range(R - 1):
            steps.append(dec.forward(resp[:, t : t + 1], pos[:, -1:] + 1 + t))
    logp = torch.log_softmax(torch.stack(steps, 1) / temperature, -1)  # (B, R, V)
    fast = logp.gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    fast_entropy = -(logp.exp() * logp).sum(-1)
    full, entropy, _ = policy_forward(
        model,
        torch.cat([ids, resp], 1),
        torch.cat([mask, resp_mask.long()], 1),
        P,
        temperature=temperature,
        with_entropy=True,
    )
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_entropy, entropy, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_sample_returns_the_log_probs_entropy_and_values_a_full_forward_gives(arch, engine):
    """What PPO's rollout takes from the decode steps instead of a second forward pass (fp32): the sampled
    tokens' log-probs and entropies under logits / T and the shared-trunk values equal policy_forward's on
    the finished sequences, on every real response token (EOS on, so rows end at different lengths)."""
    model, temperature = MODELS[arch](), 0.7
    torch.manual_seed(5)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    ids, mask = left_padded_prompts()
    params = SamplingParams(max_new_tokens=40, temperature=temperature)
    out = sample(
        model,
        ids,
        mask,
        params,
        EOS,
        PAD,
        torch.Generator().manual_seed(4),
        engine=engine,
        with_log_probs=True,
        value_head=head,
    )
    resp, m = out.response_ids, out.response_mask
    assert not m.all() and m[:, 0].all()  # some rows stopped early: the masks matter
    plain, _ = generate(model, ids, mask, params, EOS, PAD, torch.Generator().manual_seed(4), engine=engine)
    assert torch.equal(plain, resp)  # asking for the statistics does not change the samples
    with torch.no_grad():
        lp, ent, values = policy_forward(
            model,
            torch.cat([ids, resp], 1),
            torch.cat([mask, m.long()], 1),
            ids.shape[1],
            temperature,
            with_entropy=True,
            value_head=head,
        )
    torch.testing.assert_close(out.log_probs[m], lp[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy[m], ent[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.values[m], values[m], atol=1e-5, rtol=1e-5)


def test_policy_forward_matches_plain_forward_and_is_differentiable():
    model = tiny_gpt2()
    ids, mask = left_padded_prompts()
    resp = torch.randint(3, V, (ids.shape[0], 6))
    full_ids, full_mask = torch.cat([ids, resp], 1), torch.cat([mask, torch.ones_like(resp)], 1)
    P, T = ids.shape[1], full_ids.shape[1]
    head = torch.nn.Linear(32, 1)
    log_probs, entropy, values = policy_forward(model, full_ids, full_mask, P, value_head=head)
    assert entropy is None
    out = model(
        input_ids=full_ids,
        attention_mask=full_mask,
        position_ids=position_ids_from_mask(full_mask),
        output_hidden_states=True,
    )
    ref = torch.log_softmax(out.logits[:, P - 1 : T - 1], -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(log_probs, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, head(out.hidden_states[-1][:, P - 1 : T - 1]).squeeze(-1))
    (log_probs.sum() + values.sum()).backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0
    assert head.weight.grad.abs().sum() > 0


def test_critic_forward_reads_values_at_positions_predicting_the_response():
    critic = ScalarModel(tiny_gpt2().transformer, seed=0).eval()
    ids, mask = left_padded_prompts()
    full_ids = torch.cat([ids, torch.randint(3, V, (ids.shape[0], 5))], 1)
    full_mask = torch.cat([mask, torch.ones(ids.shape[0], 5, dtype=torch.long)], 1)
    P = ids.shape[1]
    values = critic_forward(critic, full_ids, full_mask, P)
    assert values.shape == (ids.shape[0], 5)
    torch.testing.assert_close(values, critic(full_ids, full_mask)[:, P - 1 : -1])


def test_rollout_select_keeps_rows_together_and_is_frozen():
    B, P, R = 4, 3, 5
    g = torch.Generator().manual_seed(0)
    per_token = {
        k: torch.randn(B, R, generator=g) for k in ("old_log_probs", "ref_log_probs", "values", "entropy")
    }
    rollout = Rollout(
        input_ids=torch.arange(B * (P + R)).view(B, P + R),
        attention_mask=torch.ones(B, P + R, dtype=torch.long),
        response_mask=torch.rand(B, R, generator=g) > 0.3,
        prompt_len=P,
        scores=torch.arange(B, dtype=torch.float),
        eos_found=torch.tensor([True, False, True, False]),
        rows=[{"i": i} for i in range(B)],
        **per_token,
    )
    assert len(rollout) == B
    idx = torch.tensor([3, 1])
    sub = rollout.select(idx)
    assert len(sub) == 2 and sub.prompt_len == P and sub.advantages is None
    assert sub.rows == [{"i": 3}, {"i": 1}]
    for name in ("input_ids", "response_mask", "scores", "eos_found", *per_token):
        assert torch.equal(getattr(sub, name), getattr(rollout, name)[idx]), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        rollout.scores = torch.zeros(B)


def expected_after_eos(raw: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference loop: keep tokens up to and including the first EOS, pad and mask the rest, trim R."""
    ids, mask = raw.clone(), torch.zeros_like(raw, dtype=torch.bool)
    for b in range(raw.shape[0]):
        for t in range(raw.shape[1]):
            mask[b, t] = True
            if raw[b, t] == EOS:
                ids[b, t + 1 :] = pad
                break
    R = int(mask.sum(1).max())
    return ids[:, :R], mask[:, :R]


@pytest.mark.parametrize("pad", [PAD, EOS])
@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_everything_after_first_eos_is_pad_and_masked(pad, engine):
    # a 6-token vocabulary at temperature 2 emits EOS early in most rows; pad == EOS must work too
    model = tiny_gpt2(vocab=6)
    ids, mask = left_padded_prompts((5, 2, 4, 3, 5, 1, 2, 4), pad=pad)
    ids = ids.clamp(max=5).masked_fill(mask == 0, pad)
    base = SamplingParams(max_new_tokens=40, temperature=2.0, stop_at_eos=False)
    raw, raw_mask = generate(
        model, ids, mask, base, EOS, pad, torch.Generator().manual_seed(0), engine=engine
    )
    assert raw.shape[1] == 40 and raw_mask.all()
    stop = SamplingParams(max_new_tokens=40, temperature=2.0, stop_at_eos=True)
    out, out_mask = generate(
        model, ids, mask, stop, EOS, pad, torch.Generator().manual_seed(0), engine=engine
    )
    ref_ids, ref_mask = expected_after_eos(raw, pad)
    assert (raw == EOS).any(1).all(), "every row should emit EOS with this seed"
    assert out.shape[1] < 40  # decoding stopped once every row was done
    assert torch.equal(out, ref_ids)
    assert torch.equal(out_mask, ref_mask)


def test_all_done_hook_keeps_stepping_until_global_done():
    model = tiny_gpt2(vocab=6)
    ids, mask = left_padded_prompts((3, 2), seed=4)
    ids = ids.clamp(max=5)
    params = SamplingParams(max_new_tokens=30, temperature=2.0)
    local, _ = generate(model, ids, mask, params, EOS, PAD, torch.Generator().manual_seed(0))
    calls = []
    out, out_mask = generate(
        model,
        ids,
        mask,
        params,
        EOS,
        PAD,
        torch.Generator().manual_seed(0),
        all_done=lambda done: calls.append(done) or False,
    )  # another rank never done
    assert out.shape[1] == 30 and len(calls) == 30
    assert torch.equal(out[:, : local.shape[1]], local)
    assert not out_mask[:, local.shape[1] :].any()


def test_seeded_generator_gives_identical_samples():
    model = tiny_llama()
    ids, mask = left_padded_prompts()
    params = SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.9)
    a = generate(model, ids, mask, params, EOS, PAD, torch.Generator().manual_seed(7))
    b = generate(model, ids, mask, params, EOS, PAD, torch.Generator().manual_seed(7))
    c = generate(model, ids, mask, params, EOS, PAD, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_top_k_never_samples_outside_the_k_most_likely():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 2
    allowed = logits.topk(5, dim=-1).indices
    seen = torch.zeros(4, 50, dtype=torch.bool)
    for _ in range(400):
        tok = sample_next(logits, SamplingParams(max_new_tokens=1, top_k=5, temperature=1.5), g)
        seen[torch.arange(4), tok] = True
    support = torch.zeros_like(seen).scatter_(1, allowed, True)
    assert not (seen & ~support).any()
    assert torch.equal(seen, support)  # and every one of the k is reachable


def test_top_p_samples_only_the_smallest_set_reaching_p():
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03], [0.05, 0.9, 0.02, 0.02, 0.01]])
    logits = probs.log()
    seen = torch.zeros_like(probs, dtype=torch.bool)
    for _ in range(400):
        tok = sample_next(logits, SamplingParams(max_new_tokens=1, top_p=0.8), g)
        seen[torch.arange(2), tok] = True
    # row 0: 0.5 + 0.25 < 0.8, so the 0.15 token completes the set; row 1: the 0.9 token alone
    assert seen.tolist() == [[True, True, True, False, False], [False, True, False, False, False]]


def test_top_k_then_top_p_in_generation_stays_in_support():
    model = tiny_gpt2()
    ids, mask = left_padded_prompts()
    params = SamplingParams(max_new_tokens=8, top_k=4, top_p=0.9, temperature=1.0, stop_at_eos=False)
    resp, resp_mask = generate(model, ids, mask, params, EOS, PAD, torch.Generator().manual_seed(2))
    full_ids, full_mask = torch.cat([ids, resp], 1), torch.cat([mask, resp_mask.long()], 1)
    P = ids.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=full_ids, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)
        ).logits[:, P - 1 : -1]
    rank = (logits > logits.gather(-1, resp.unsqueeze(-1))).sum(-1)  # 0 = most likely
    assert (rank < 4).all()


def test_llama_with_attention_bias_matches_hf_generate():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        attention_bias=True,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=PAD,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to 0; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    ids, mask = left_padded_prompts()
    params = SamplingParams(max_new_tokens=8, greedy=True, stop_at_eos=False)
    resp, _ = generate(model, ids, mask, params, EOS, PAD, engine="fast")
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=8,
            min_new_tokens=8,
            pad_token_id=PAD,
            eos_token_id=None,
        )
    assert torch.equal(resp, ref[:, ids.shape[1] :])


def test_prompt_plus_response_past_learned_positions_is_a_clear_error(tiny_model_dir):
    from shifu.errors import ShifuError
    from shifu.models.loading import build_tiny_gpt2, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    model = build_tiny_gpt2(tok, n_layer=1, n_embd=16, n_head=2, n_positions=12)
    ids = torch.randint(3, 50, (2, 10))
    with pytest.raises(ShifuError, match="exceeds the model's 12 positions"):
        generate(
            model,
            ids,
            torch.ones_like(ids),
            SamplingParams(max_new_tokens=4),
            tok.eos_token_id,
            tok.pad_token_id,
        )
    # the task helpers keep the prompt's tail instead of failing
    from shifu.tasks import sample_responses

    texts = sample_responses(
        model, tok, ["the movie was great and the acting was good " * 3], max_new_tokens=4
    )
    assert len(texts) == 1


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_decode_head_layout_follows_the_measurement_and_is_kept_per_machine(arch, tmp_path, monkeypatch):
    """The fast decoders read the output embedding as ``(W @ h^T)^T`` only where the probe measured it
    faster by enough to matter; the answer is written to the probe's cache and read back (no re-timing, so
    the rounding cannot change between runs), and that order gives the log-probs a full forward gives."""
    import shifu.generation.decode as dec

    monkeypatch.setenv("SHIFU_CACHE", str(tmp_path))
    timed = []
    answers = {"fast": (0.010, 0.004), "noise": (2e-4, 1e-4)}  # (plain, left) seconds
    monkeypatch.setattr(dec, "_time_head", lambda w, rows: timed.append(rows) or answers[mode])
    model = MODELS[arch]()
    ids, mask = left_padded_prompts()
    B, P = ids.shape
    weight = model.get_output_embeddings().weight
    n, d = weight.shape

    def key(rows):
        return f"decode head {rows}x{d}x{n} float32"

    mode = "noise"  # left twice as fast but saving 0.1 ms, under HEAD_MIN_SAVING_S: the plain order stays
    monkeypatch.setattr(dec, "_HEAD_LAYOUTS", {})
    dec.head_product(weight, B), dec.head_product(weight, 8)
    assert dec._HEAD_LAYOUTS == {key(B): False, key(8): False} and timed == [B, 8]

    mode = "fast"
    (tmp_path / "bf16_probe.json").unlink()
    monkeypatch.setattr(dec, "_HEAD_LAYOUTS", {})
    left = dec.head_product(weight, B)
    assert dec._HEAD_LAYOUTS == {key(B): True}
    h = torch.randn(B, d)
    torch.testing.assert_close(left(h), torch.nn.functional.linear(h, weight), atol=1e-5, rtol=1e-5)
    assert left(h).is_contiguous()

    mode = "noise"  # a new process (empty memo) reads the answer from the cache file, times nothing
    monkeypatch.setattr(dec, "_HEAD_LAYOUTS", {})
    dec.head_product(weight, B)
    assert dec._HEAD_LAYOUTS == {key(B): True} and timed == [B, 8, B]

    # the decoder built on that answer samples with the log-probs a full forward gives
    params = SamplingParams(max_new_tokens=6, temperature=0.7, stop_at_eos=False)
    out = sample(
        model,
        ids,
        mask,
        params,
        EOS,
        PAD,
        torch.Generator().manual_seed(3),
        engine="fast",
        with_log_probs=True,
    )
    m = out.response_mask
    with torch.no_grad():
        full, _, _ = policy_forward(
            model, torch.cat([ids, out.response_ids], 1), torch.cat([mask, m.long()], 1), P, temperature=0.7
        )
    torch.testing.assert_close(out.log_probs[m], full[m], atol=1e-5, rtol=1e-5)


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p = 1e-50 is 0 in float32: nucleus sampling still keeps the most likely token (it is greedy), never an
    empty set of candidates."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.2, -2.0]])
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        tok = sample_next(logits, SamplingParams(1, temperature=1.0, top_p=1e-50), g)
        assert tok.tolist() == [1, 0]


def test_a_source_describes_itself_as_a_run_records_it(tmp_path):
    """Every kind of source states what it is; the description a run records reads back as it was, and a
    recorded config without one (a run from before runs recorded it) is described as its source would be."""
    from shifu.config.loader import lookup
    from shifu.rollout.build import describe_settings
    from shifu.rollout.sources import SingleTurn, SourceDescription

    (tmp_path / "ens").mkdir()
    (tmp_path / "ens" / "ensemble.json").write_text("{}")  # shifu.rewards.ensemble.ENSEMBLE_FILE
    cases = [
        ({"agent": {"factory": "a:solve"}}, "agent a:solve", "agent", "agent's reward", True),
        ({"env": {"factory": "g:Guess"}}, "environment g:Guess", "environment", "environment reward", True),
        (
            {"reward": {"url": "http://h:1"}},
            "reward service http://h:1",
            "single-turn",
            "reward service",
            False,
        ),
        ({"reward": {"function": "m:f"}}, "reward function m:f", "single-turn", "reward function", False),
        ({"reward": {"model_path": "rm"}}, "reward model rm", "single-turn", "reward model", False),
        (
            {"reward": {"model_path": str(tmp_path / "ens")}},
            None,
            "single-turn",
            "reward-model ensemble",
            False,
        ),
    ]
    for config, name, kind, scored_by, gold in cases:
        d = describe_settings(lambda key, c=config: lookup(c, key))
        assert (d.kind, d.scored_by, d.gold, d.episodes) == (kind, scored_by, gold, kind != "single-turn")
        assert name is None or d.name == name
        assert d.judge == (f"episode return of {d.spec}" if gold else None)
        assert d.reward_model == (d.spec if "model" in scored_by else None)
        assert SourceDescription.from_record(json.loads(json.dumps(d.record()))) == d
    assert describe_settings(lambda key: None) == SourceDescription("single-turn")
    assert (
        SourceDescription.from_record({"evals": []}) is None and SourceDescription.from_record(None) is None
    )
    assert SingleTurn(None, scored_by="reward function", spec="m:f").name == "reward function m:f"
    assert SingleTurn(None).description.unit == "responses"

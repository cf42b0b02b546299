"""log_probs_from_logits / entropy_from_logits / log_probs_and_entropy against log_softmax, with chunking,
temperature, autograd."""

import math

import pytest
import torch

from shifu.core import (
    entropy_from_logits,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
    log_probs_from_hidden,
    log_probs_from_logits,
)

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def reference_log_probs(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_hand_computed_case():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # uniform; then p = (3/4, 1/4)
    tokens = torch.tensor([[1, 0]])
    torch.testing.assert_close(
        log_probs_from_logits(logits, tokens), torch.tensor([[math.log(0.5), math.log(0.75)]])
    )
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[math.log(2.0), h]]))


@pytest.mark.parametrize("chunk_elements", [2**22, 50, 7, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_log_softmax(chunk_elements, temperature):
    torch.manual_seed(0)
    full = torch.randn(3, 9, 11)
    logits = full[:, 1:-1]  # a non-contiguous slice, as the trainer passes it
    tokens = torch.randint(0, 11, (3, 7))
    got = log_probs_from_logits(logits, tokens, temperature, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, reference_log_probs(logits, tokens, temperature))
    expected_h = -(torch.softmax(logits / temperature, -1) * torch.log_softmax(logits / temperature, -1)).sum(
        -1
    )
    torch.testing.assert_close(
        entropy_from_logits(logits, temperature, chunk_elements=chunk_elements), expected_h
    )


def test_gradients_match_log_softmax_when_chunked():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 6, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 5))
    weights = torch.randn(2, 5)
    (log_probs_from_logits(logits, tokens, 0.9, chunk_elements=12) * weights).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    (reference_log_probs(logits, tokens, 0.9) * weights).sum().backward()
    torch.testing.assert_close(got, logits.grad)


def test_bf16_logits_are_upcast():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 5).to(torch.bfloat16)
    tokens = torch.randint(0, 5, (2, 3))
    out = log_probs_from_logits(logits, tokens)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference_log_probs(logits, tokens))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="tokens shape"):
        log_probs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradcheck_in_float64(temperature):
    """The hand-written backward passes agree with finite differences (chunked, non-contiguous input)."""
    torch.manual_seed(3)
    full = torch.randn(2, 5, 4, dtype=torch.float64)
    tokens = torch.randint(0, 4, (2, 3))

    def log_probs(x):
        return log_probs_from_logits(x[:, 1:4], tokens, temperature, chunk_elements=8).double()

    def entropy(x):
        return entropy_from_logits(x[:, 1:4], temperature, chunk_elements=8).double()

    # outputs are float32, so compare the backward against float64 references instead of gradcheck's
    # own finite differences at float32 precision
    x = full.clone().requires_grad_(True)
    w = torch.randn(2, 3, dtype=torch.float64)
    (log_probs(x) * w).sum().backward()
    ref = full.clone().requires_grad_(True)
    (reference_log_probs(ref[:, 1:4], tokens, temperature) * w).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)

    x.grad, ref.grad = None, None
    (entropy(x) * w).sum().backward()
    u = ref[:, 1:4] / temperature
    (-(torch.softmax(u, -1) * torch.log_softmax(u, -1)).sum(-1) * w).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_no_second_full_size_tensor_is_created():
    """Forward and backward with chunking: every op output is chunk-sized except the one gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargeAllocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.large = set()  # storages of op outputs larger than the chunk budget

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() > budget:
                    self.large.add(t.untyped_storage().data_ptr())  # views and detach share a storage
            return out

    torch.manual_seed(4)
    logits = torch.randn(4, 16, 32).to(torch.bfloat16).requires_grad_(True)  # 2048 logits
    tokens = torch.randint(0, 32, (4, 16))
    budget = 128
    for fn in (
        lambda: log_probs_from_logits(logits, tokens, 0.7, chunk_elements=budget),
        lambda: entropy_from_logits(logits, 0.7, chunk_elements=budget),
        lambda: sum(log_probs_and_entropy(logits, tokens, 0.7, chunk_elements=budget)),
    ):
        logits.grad = None
        mode = LargeAllocations()
        with mode:
            fn().sum().backward()
        # one (B, T, V) allocation: the gradient itself (which becomes logits.grad); no copy of the logits
        assert mode.large == {logits.grad.untyped_storage().data_ptr()}


@pytest.mark.parametrize("chunk_elements", [2**22, 12, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_joint_log_probs_and_entropy_equal_the_separate_functions(chunk_elements, temperature):
    """Values and gradients (through either output or both) equal log_softmax references, in float64."""
    torch.manual_seed(5)
    full = torch.randn(3, 7, 9, dtype=torch.float64)
    tokens = torch.randint(0, 9, (3, 5))
    w_lp, w_h = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)

    def reference(x):
        u = x[:, 1:6] / temperature
        logp = torch.log_softmax(u, -1)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)

    for use_lp, use_h in ((True, True), (True, False), (False, True)):
        x = full.clone().requires_grad_(True)
        lp, h = log_probs_and_entropy(x[:, 1:6], tokens, temperature, chunk_elements=chunk_elements)
        ref = full.clone().requires_grad_(True)
        ref_lp, ref_h = reference(ref)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h.double(), ref_h, rtol=1e-5, atol=1e-6)
        loss = (lp.double() * w_lp).sum() * use_lp + (h.double() * w_h).sum() * use_h
        (loss).backward()
        ((ref_lp * w_lp).sum() * use_lp + (ref_h * w_h).sum() * use_h).backward()
        torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_entropy_without_grad_stays_out_of_the_graph():
    torch.manual_seed(6)
    logits = torch.randn(2, 4, 8, requires_grad=True)
    tokens = torch.randint(0, 8, (2, 4))
    lp, h = log_probs_and_entropy(logits, tokens, entropy_grad=False)
    assert lp.requires_grad and not h.requires_grad
    lp.sum().backward()
    expected = logits.detach().clone().requires_grad_(True)
    reference_log_probs(expected, tokens).sum().backward()
    torch.testing.assert_close(logits.grad, expected.grad)


# ---------------------------------------------------------------------------------------------------------
# from the hidden states: the output layer applied a chunk at a time
# ---------------------------------------------------------------------------------------------------------
def _head_reference(hidden, weight, bias, tokens, temperature):
    """log p(y) and H through the whole logits tensor, in the inputs' dtype."""
    logp = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias) / temperature, -1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_elements", [2**22, 40, 9, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_from_hidden_equals_the_layer_then_log_softmax(chunk_elements, temperature, with_bias):
    """Values and gradients for hidden, weight and bias (through either output or both) equal a float64
    log_softmax of the layer's whole output, whatever the chunking (one chunk: the logits path itself)."""
    torch.manual_seed(7)
    B, T, d, V = 3, 5, 4, 9
    hidden0, weight0 = torch.randn(B, T + 2, d, dtype=torch.float64), torch.randn(V, d, dtype=torch.float64)
    bias0 = torch.randn(V, dtype=torch.float64) if with_bias else None
    tokens = torch.randint(0, V, (B, T))
    w_lp, w_h = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    tol = {"rtol": 1e-5, "atol": 1e-5}  # the chunks compute in float32

    def leaves():
        return [None if t is None else t.clone().requires_grad_(True) for t in (hidden0, weight0, bias0)]

    for use_lp, use_h in ((True, True), (True, False), (False, True), (True, None)):
        h, w, b = leaves()
        if use_h is None:  # log-probs alone
            lp, ent = log_probs_from_hidden(h[:, 1:-1], w, tokens, temperature, b, chunk_elements), None
        else:
            lp, ent = log_probs_and_entropy_from_hidden(h[:, 1:-1], w, tokens, temperature, b, chunk_elements)
        rh, rw, rb = leaves()
        ref_lp, ref_h = _head_reference(rh[:, 1:-1], rw, rb, tokens, temperature)
        torch.testing.assert_close(lp.double(), ref_lp, **tol)
        loss, ref_loss = (lp.double() * w_lp).sum() * use_lp, (ref_lp * w_lp).sum() * use_lp
        if ent is not None:
            torch.testing.assert_close(ent.double(), ref_h, **tol)
            loss, ref_loss = loss + (ent.double() * w_h).sum() * use_h, ref_loss + (ref_h * w_h).sum() * use_h
        loss.backward()
        ref_loss.backward()
        for got, want in ((h, rh), (w, rw), (b, rb)):
            if got is not None:
                torch.testing.assert_close(got.grad, want.grad, **tol)


def test_from_hidden_under_bf16_autocast_computes_the_layer_in_bf16():
    """Under autocast the layer runs in bf16 as the module would: the log-probs and entropies are the
    logits path's on autocast's own F.linear, and the gradients are that path's up to bf16 rounding."""
    torch.manual_seed(8)
    hidden0, weight0 = torch.randn(2, 6, 16), torch.randn(40, 16) * 0.5
    tokens = torch.randint(0, 40, (2, 6))
    results = []
    for chunk_elements in (2**22, 80):  # one chunk (the logits path) and six
        h, w = hidden0.clone().requires_grad_(True), weight0.clone().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16):
            lp, ent = log_probs_and_entropy_from_hidden(h, w, tokens, 0.8, chunk_elements=chunk_elements)
        (lp.sum() + ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    (lp1, ent1, gh1, gw1), (lp2, ent2, gh2, gw2) = results
    assert lp2.dtype == torch.float32 and gh2.dtype == gw2.dtype == torch.float32
    torch.testing.assert_close(lp2, lp1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent2, ent1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh2, gh1, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gw2, gw1, rtol=2e-2, atol=2e-2)
    with torch.no_grad():  # and bf16 it is: far from the float32 layer's values
        lp32 = log_probs_from_hidden(hidden0, weight0, tokens, 0.8, chunk_elements=80)
    assert (lp32 - lp2).abs().max() > 1e-3


def test_from_hidden_makes_no_vocabulary_wide_tensor():
    """Forward and backward: no op output as large as the (B, T, V) logits; the largest are the weight's
    gradient (V, d) and the chunk-sized temporaries."""
    from test_lm_head import Largest

    torch.manual_seed(9)
    B, T, d, V, budget = 4, 16, 8, 64, 128  # logits 4096, weight 512, two rows a chunk
    hidden, weight = torch.randn(B, T, d, requires_grad=True), torch.randn(V, d, requires_grad=True)
    tokens = torch.randint(0, V, (B, T))
    for fn in (
        lambda: log_probs_from_hidden(hidden, weight, tokens, 0.7, chunk_elements=budget),
        lambda: sum(log_probs_and_entropy_from_hidden(hidden, weight, tokens, 0.7, chunk_elements=budget)),
    ):
        mode = Largest()
        with mode:
            fn().sum().backward()
        assert mode.numel == max(V * d, B * T * d) < B * T * V
    mode = Largest()
    with mode:  # the logits path, for contrast: the test sees a (B, T, V) tensor where there is one
        log_probs_from_logits(torch.nn.functional.linear(hidden, weight), tokens).sum().backward()
    assert mode.numel == B * T * V


def test_from_hidden_entropy_without_grad_and_frozen_weight():
    """``entropy_grad=False`` keeps the entropy out of the graph; a weight that needs no gradient gets
    none (a LoRA actor's frozen output layer: no (V, d) buffer is made)."""
    torch.manual_seed(10)
    hidden, weight = torch.randn(2, 5, 4, requires_grad=True), torch.randn(7, 4)
    tokens = torch.randint(0, 7, (2, 5))
    lp, ent = log_probs_and_entropy_from_hidden(hidden, weight, tokens, chunk_elements=7, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    lp.sum().backward()
    expected = hidden.detach().clone().requires_grad_(True)
    _head_reference(expected, weight, None, tokens, 1.0)[0].float().sum().backward()
    torch.testing.assert_close(hidden.grad, expected.grad)
    assert weight.grad is None


def test_from_hidden_bad_inputs_raise():
    with pytest.raises(ValueError, match="weight"):
        log_probs_from_hidden(torch.zeros(1, 2, 3), torch.zeros(5, 4), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens shape"):
        log_probs_from_hidden(torch.zeros(1, 2, 3), torch.zeros(5, 3), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="bias"):
        log_probs_from_hidden(
            torch.zeros(1, 2, 3), torch.zeros(5, 3), torch.zeros(1, 2, dtype=torch.long), bias=torch.zeros(4)
        )

"""log_probs_from_logits / entropy_from_logits / log_probs_and_entropy against log_softmax, with chunking,
temperature, autograd."""

import math

import pytest
import torch

from shifu.core import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits

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

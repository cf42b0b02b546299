"""shifu.core is pure: importing it pulls in no heavy framework and nothing else from shifu."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import shifu.core

CORE = Path(shifu.core.__file__).parent
ALLOWED_TOP_LEVEL = {"torch", "__future__", "math", "typing", "collections"}


@pytest.mark.integration
def test_import_core_pulls_in_no_framework():
    code = (
        "import sys, shifu.core\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'transformers', 'accelerate', 'deepspeed', 'datasets', 'tokenizers', 'yaml', 'safetensors'})\n"
        "other = sorted(m for m in sys.modules if m.startswith('shifu.') and not m.startswith('shifu.core'))\n"
        "print(bad, other)\n"
        "assert not bad and not other, (bad, other)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.unit
def test_core_sources_import_only_torch_and_the_standard_library():
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in ALLOWED_TOP_LEVEL, f"{path.name} imports {name}"


@pytest.mark.unit
def test_public_names():
    expected = {
        "masked_sum",
        "last_true",
        "masked_mean",
        "masked_var",
        "masked_whiten",
        "log_probs_from_logits",
        "log_probs_and_entropy",
        "log_probs_from_hidden",
        "log_probs_and_entropy_from_hidden",
        "entropy_from_logits",
        "kl_estimate",
        "shape_rewards",
        "gae",
        "ppo_policy_loss",
        "ppo_value_loss",
        "ppo_penalty_loss",
        "bradley_terry_loss",
        "dpo_loss",
        "FixedKLController",
        "AdaptiveKLController",
        "StepKLController",
        "PenaltyKLController",
        "build_kl_controller",
        "RunningMoments",
        "mean_se",
        "explained_variance",
        "penalize_missing_eos",
        "normalize_scores",
        "sequence_returns",
        "sequence_advantages",
        "reinforce_loss",
        "POLICY_LOSSES",
        "group_advantages",
        "group_step_advantages",
        "subtract_group_mean",
        "dynamic_sampling_mask",
        "discounted_returns",
        "shape_token_rewards",
        "place_step_rewards",
        "gspo_policy_loss",
        "kl_loss",
        "exact_kl",
        "exact_kl_loss",
        "truncated_is_weights",
        "decoupled_is_weights",
        "outside_band",
        "rollout_mismatch",
        "conjugate_gradient",
    }
    assert set(shifu.core.__all__) == expected
    assert all(hasattr(shifu.core, name) for name in expected)

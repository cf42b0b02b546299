"""shifu: PPO-RLHF.

``from shifu import Step, ToolEnv``: the environment interface of multi-turn episodes (:mod:`shifu.envs`),
imported on first use so that ``import shifu`` stays light.
"""

import os as _os

# No network at run time: every model and tokenizer comes from a local directory. Set here, before any
# shifu module can import transformers / huggingface_hub (which read it once, at import).
_os.environ.setdefault("HF_HUB_OFFLINE", "1")

__version__ = "0.1.0"
__all__ = ["Step", "ToolEnv", "__version__"]


def __getattr__(name: str):
    if name == "Step":
        from shifu.envs.base import Step

        return Step
    if name == "ToolEnv":
        from shifu.envs.tool import ToolEnv

        return ToolEnv
    raise AttributeError(f"module 'shifu' has no attribute {name!r}")
